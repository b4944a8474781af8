"""What holds the driver's place on actor ranks above 0 (`megatron_bapo.driver`'s counterpart)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from megatron_bapo.sync.export import NullSink


class Follower:
    """Holds the driver's place on actor ranks above 0: no servers, no data, no metrics. It answers
    the loop's calls so the loop reads the same on every rank (its slice of the batch comes from
    rank 0 through `actor.scatter`)."""

    leads = False

    def next_batch(self, step: int, version: int) -> tuple[None, dict[str, float]]:
        return None, {}

    @contextlib.contextmanager
    def weight_update(self, version: int, probe: Any = None) -> Iterator[Any]:
        yield NullSink()  # this rank takes part in the export's gathers; rank 0 delivers

    def evaluate(self, step: int) -> dict[str, float]:
        return {}

    def begin_stop(self) -> None:
        return None

    def close(self) -> None:
        return None
