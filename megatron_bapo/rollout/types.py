"""Rollout data: prompts in, samples and groups out (plain dataclasses, JSON-safe via to_dict).

Per-token lists are aligned: `response_ids[i]` was generated with log-prob `response_logprobs[i]`
by policy version `response_versions[i]`. A mixture-of-experts rollout also keeps, per position of
prompt + response, the experts every MoE layer chose (`Sample.routed_experts`, for routing replay).
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Prompt:
    """One prompt as the dataset hands it to rollout."""

    prompt_ids: list[int]
    answer: str = ""
    index: int = -1
    """Row index in the dataset (for logs and de-duplication); -1 when unknown."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Other columns of the row (JSON-safe), passed through to the reward function's caller."""

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "answer": self.answer, "index": self.index,
                "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Prompt":
        return cls(prompt_ids=[int(x) for x in d["prompt_ids"]], answer=str(d.get("answer", "")),
                   index=int(d.get("index", -1)), metadata=dict(d.get("metadata") or {}))


class SampleState(str, enum.Enum):
    """Where a sample stands. COMPLETED and TRUNCATED are finished; FAILED is dropped with its group."""

    PENDING = "pending"
    """Nothing generated yet (new, or reset for regeneration)."""
    PARTIAL = "partial"
    """The last segment used up its token budget before max_response_tokens; resumed next step."""
    ABORTED = "aborted"
    """The last segment was aborted (abort_all / pause); its tokens are kept and it is resumed."""
    COMPLETED = "completed"
    """Stopped on EOS, a stop token or a stop string."""
    TRUNCATED = "truncated"
    """Reached max_response_tokens (or the server's context limit) without stopping."""
    FAILED = "failed"
    """A server rejected the request (4xx): retrying cannot help."""

    @property
    def finished(self) -> bool:
        return self in (SampleState.COMPLETED, SampleState.TRUNCATED)

    @property
    def resumable(self) -> bool:
        return self in (SampleState.PENDING, SampleState.PARTIAL, SampleState.ABORTED)


@dataclass
class Sample:
    """One response of a group, possibly built from several segments."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    """Behavior log-prob of each response token, as the server returned it."""
    response_versions: list[int] = field(default_factory=list)
    """Policy version that generated each response token."""
    state: SampleState = SampleState.PENDING
    finish_reason: Optional[dict[str, Any]] = None
    """The server's `meta_info.finish_reason` of the last segment."""
    num_segments: int = 0
    num_regenerations: int = 0
    """Times the sample was thrown away for exceeding max_staleness and started again."""
    error: Optional[str] = None
    reward: Optional[float] = None
    """The reward training sees (`experience.score_groups`, when the group finished); None until then."""
    routed_experts: bytes = b""
    """Mixture-of-experts routing: int16 little-endian `[rows, routed_width]` (row p: the experts every
    MoE layer chose for position p of prompt + response, `num_layers x top_k` ids), rows 0..n-1
    contiguous; each segment appends the rows of the positions it computed first (SGLang's
    `meta_info.routed_experts` from `routed_experts_start_len = rows so far`). Empty: none recorded."""
    routed_width: int = 0
    """Ids per row (`num_layers x top_k`); 0 while nothing is recorded."""

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def routed_rows(self) -> int:
        """Positions with a recorded routing (0 .. routed_rows - 1)."""
        return len(self.routed_experts) // (2 * self.routed_width) if self.routed_width else 0

    def reset(self) -> None:
        """Drop everything generated (regeneration from scratch)."""
        self.response_ids, self.response_logprobs, self.response_versions = [], [], []
        self.state, self.finish_reason, self.num_segments = SampleState.PENDING, None, 0
        self.routed_experts, self.routed_width = b"", 0
        self.reward = None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
                "response_logprobs": [float(x) for x in self.response_logprobs],
                "response_versions": list(self.response_versions), "state": self.state.value,
                "finish_reason": self.finish_reason, "num_segments": self.num_segments,
                "num_regenerations": self.num_regenerations, "error": self.error, "reward": self.reward,
                "routed_experts": base64.b64encode(self.routed_experts).decode("ascii"),
                "routed_width": self.routed_width}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        return cls(prompt_ids=[int(x) for x in d["prompt_ids"]], response_ids=[int(x) for x in d["response_ids"]],
                   response_logprobs=[float(x) for x in d["response_logprobs"]],
                   response_versions=[int(x) for x in d["response_versions"]], state=SampleState(d["state"]),
                   finish_reason=d.get("finish_reason"), num_segments=int(d.get("num_segments", 0)),
                   num_regenerations=int(d.get("num_regenerations", 0)), error=d.get("error"),
                   reward=d.get("reward"), routed_experts=base64.b64decode(d.get("routed_experts") or ""),
                   routed_width=int(d.get("routed_width", 0)))


@dataclass
class RolloutGroup:
    """The G samples of one prompt. Returned to the trainer only when all are finished."""

    group_id: str
    prompt: Prompt
    samples: list[Sample]
    start_version: int
    """Policy version when the group was first scheduled."""

    @property
    def finished(self) -> bool:
        return all(s.state.finished for s in self.samples)

    @property
    def failed(self) -> bool:
        return any(s.state is SampleState.FAILED for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "prompt": self.prompt.to_dict(),
                "samples": [s.to_dict() for s in self.samples], "start_version": self.start_version}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RolloutGroup":
        return cls(group_id=str(d["group_id"]), prompt=Prompt.from_dict(d["prompt"]),
                   samples=[Sample.from_dict(s) for s in d["samples"]], start_version=int(d["start_version"]))


@dataclass
class GenerateResult:
    """One `/generate` reply, parsed: the new tokens of one segment."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[Optional[int]]
    """Per token; None where the server's weight_version is not an integer (e.g. "default")."""
    finish_type: str
    """"stop", "length", "abort" or "error" (the request was rejected with a 4xx)."""
    finish_reason: dict[str, Any]
    rid: str
    url: str
    error: Optional[str] = None
    text: str = ""
    """The server's decoded output (for evaluation; training uses the ids)."""
    routed_experts: Optional[bytes] = None
    """`meta_info.routed_experts` decoded: int32 little-endian ids (SGLang's wire form), None when the
    reply has none."""
