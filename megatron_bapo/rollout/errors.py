"""Rollout exceptions."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A rollout request or control call failed on every server / retry."""


class RequestRejected(RolloutError):
    """The server answered 4xx: the request itself is wrong (too long for the context, bad
    sampling value); sending it again cannot help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ProtocolError(RolloutError):
    """A reply that does not follow the SGLang API (5xx, non-JSON, tokens without log-probs);
    retried on another server."""


class RoundInterrupted(Exception):
    """A step's rollout stopped between its rounds because the producer was paused with abort (a
    checkpoint): the step is kept by its sampler and completed when the producer resumes."""
