"""Rollout data: prompts in, samples and groups out (plain dataclasses, JSON-safe via to_dict).

Per-token lists are aligned: `response_ids[i]` was generated with log-prob `response_logprobs[i]`
by policy version `response_versions[i]`. A mixture-of-experts rollout also keeps, per position of
prompt + response, the experts every MoE layer chose (`Sample.routed_experts`, for routing replay).
In a multi-turn sample (`rollout.agent`) some response tokens were written by a tool, not sampled:
`Sample.agent.tool_spans` says which; they hold log-prob 0.0 and version `NO_VERSION` as
placeholders, and everything that trains or judges staleness reads `model_mask` / `model_versions`.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

NO_VERSION = -1
"""The version of a token no policy produced (a tool's result; off the response in a batch)."""

_LIVE = contextvars.ContextVar("rollout_to_dict_live_lists", default=False)


@contextlib.contextmanager
def live_lists() -> Iterator[None]:
    """`to_dict` hands out the objects' own token lists instead of copies (and the routing as its
    bytes, not base64), for a checkpoint's snapshot under the producer's pause (`state_tokens.snapshot`):
    a copy of every list costs ~3-6 ns a value, seconds at 32B. The snapshot records each list and its
    length and reads the values later, while the rollout goes on. That is exact because the token
    lists are only ever extended, or replaced by new lists (`Sample.reset`), never changed in place
    (`tests/test_state_tokens_invariant.py` fails on code that would)."""
    token = _LIVE.set(True)
    try:
        yield
    finally:
        _LIVE.reset(token)


def _tokens(values: list) -> list:
    return values if _LIVE.get() else list(values)


def _routing(value: bytes) -> Any:
    return value if _LIVE.get() else base64.b64encode(value).decode("ascii")


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
        return {"prompt_ids": _tokens(self.prompt_ids), "answer": self.answer, "index": self.index,
                "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Prompt":
        return cls(prompt_ids=_ints(d["prompt_ids"]), answer=str(d.get("answer", "")),
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
class AgentState:
    """Multi-turn bookkeeping of one sample (`rollout.agent`, `rollout.agent.AgentLoop`), JSON-safe
    so a sample can stop between any two tokens or between a turn and its tool call and resume."""

    tool_spans: list[list[int]] = field(default_factory=list)
    """`[start, end)` positions in `response_ids` written by tools (result tokens), in order."""
    turn_start: int = 0
    """Where the current model turn began in `response_ids` (its calls are parsed from there)."""
    pending: list[dict[str, Any]] = field(default_factory=list)
    """Calls of the last finished model turn not run yet (`tool_calls.ToolCall` dicts): the turn
    ended where a segment's budget ended, so its tools run first when the sample resumes."""
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_tool_timeouts: int = 0
    num_tool_truncated: int = 0
    tool_seconds: float = 0.0
    ended_by: Optional[str] = None
    """Why the sample finished: "answer" (a turn without a call), "max_turns" (a call in the last
    allowed turn, not run), "length" (the response budget ran out in a turn), "no_room" (a tool's
    result did not fit the response budget)."""

    @property
    def num_tool_tokens(self) -> int:
        return sum(end - start for start, end in self.tool_spans)

    def to_dict(self) -> dict[str, Any]:
        return {"tool_spans": [list(x) for x in self.tool_spans], "turn_start": self.turn_start,
                "pending": [dict(c) for c in self.pending], "num_tool_calls": self.num_tool_calls,
                "num_tool_errors": self.num_tool_errors, "num_tool_timeouts": self.num_tool_timeouts,
                "num_tool_truncated": self.num_tool_truncated, "tool_seconds": self.tool_seconds,
                "ended_by": self.ended_by}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AgentState":
        return cls(tool_spans=[[int(a), int(b)] for a, b in d.get("tool_spans", [])],
                   turn_start=int(d.get("turn_start", 0)), pending=[dict(c) for c in d.get("pending", [])],
                   num_tool_calls=int(d.get("num_tool_calls", 0)), num_tool_errors=int(d.get("num_tool_errors", 0)),
                   num_tool_timeouts=int(d.get("num_tool_timeouts", 0)),
                   num_tool_truncated=int(d.get("num_tool_truncated", 0)),
                   tool_seconds=float(d.get("tool_seconds", 0.0)), ended_by=d.get("ended_by"))


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
    agent: Optional[AgentState] = None
    """Multi-turn state (`rollout.agent`); None for a single-turn sample (every response token sampled)."""
    teacher_logprobs: Optional[list[float]] = None
    """The teacher's log-prob of each response token (`rollout.teacher`, when the group finished; a
    tool's tokens included, masked when trained); None until scored, or without a teacher."""

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def model_mask(self) -> list[bool]:
        """Per response token: sampled by the policy (True) or written by a tool (False)."""
        mask = [True] * len(self.response_ids)
        for start, end in (self.agent.tool_spans if self.agent else ()):
            mask[start:end] = [False] * (end - start)
        return mask

    @property
    def model_versions(self) -> list[int]:
        """Versions of the sampled tokens only: what staleness is judged by."""
        if not self.agent or not self.agent.tool_spans:
            return self.response_versions
        return [v for v, m in zip(self.response_versions, self.model_mask) if m]

    def append_tool_tokens(self, ids: list[int]) -> None:
        """Append a tool's result tokens: no log-prob (0.0) and no version (`NO_VERSION`), recorded as a span."""
        if self.agent is None:
            self.agent = AgentState()
        start = len(self.response_ids)
        self.response_ids.extend(int(x) for x in ids)
        self.response_logprobs.extend([0.0] * len(ids))
        self.response_versions.extend([NO_VERSION] * len(ids))
        self.agent.tool_spans.append([start, len(self.response_ids)])

    @property
    def routed_rows(self) -> int:
        """Positions with a recorded routing (0 .. routed_rows - 1)."""
        return len(self.routed_experts) // (2 * self.routed_width) if self.routed_width else 0

    def reset(self) -> None:
        """Drop everything generated (regeneration from scratch)."""
        self.response_ids, self.response_logprobs, self.response_versions = [], [], []
        self.state, self.finish_reason, self.num_segments = SampleState.PENDING, None, 0
        self.routed_experts, self.routed_width = b"", 0
        self.reward = self.teacher_logprobs = None
        if self.agent is not None:
            self.agent = AgentState()

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_ids": _tokens(self.prompt_ids), "response_ids": _tokens(self.response_ids),
                "response_logprobs": _tokens(self.response_logprobs),
                "response_versions": _tokens(self.response_versions), "state": self.state.value,
                "finish_reason": self.finish_reason, "num_segments": self.num_segments,
                "num_regenerations": self.num_regenerations, "error": self.error, "reward": self.reward,
                "routed_experts": _routing(self.routed_experts),
                "routed_width": self.routed_width, "agent": self.agent.to_dict() if self.agent else None,
                "teacher_logprobs": None if self.teacher_logprobs is None else _tokens(self.teacher_logprobs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        return cls(prompt_ids=_ints(d["prompt_ids"]), response_ids=_ints(d["response_ids"]),
                   response_logprobs=_floats(d["response_logprobs"]),
                   response_versions=_ints(d["response_versions"]), state=SampleState(d["state"]),
                   finish_reason=d.get("finish_reason"), num_segments=int(d.get("num_segments", 0)),
                   num_regenerations=int(d.get("num_regenerations", 0)), error=d.get("error"),
                   reward=d.get("reward"), routed_experts=_bytes(d.get("routed_experts")),
                   routed_width=int(d.get("routed_width", 0)),
                   agent=AgentState.from_dict(d["agent"]) if d.get("agent") else None,
                   teacher_logprobs=None if d.get("teacher_logprobs") is None else _floats(d["teacher_logprobs"]))


def _ints(values: Any) -> list[int]:
    """A token list from a state: a numpy view of a checkpoint's flat arrays (`state_tokens`), or a
    list (older checkpoints; JSON)."""
    return values.tolist() if hasattr(values, "tolist") else [int(x) for x in values]


def _floats(values: Any) -> list[float]:
    return values.tolist() if hasattr(values, "tolist") else [float(x) for x in values]


def _bytes(value: Any) -> bytes:
    """The routing from a state: a uint8 view (`state_tokens`) or base64 text (older checkpoints)."""
    return value.tobytes() if hasattr(value, "tobytes") else base64.b64decode(value or "")


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


@dataclass
class RolloutRound:
    """One round of the partial-rollout manager (`PartialRolloutManager.astep`): the prompts it drew,
    the groups that finished in it, its `rollout/*` metrics and the servers' rejections."""

    prompts: list[Prompt]
    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    rejections: list[str] = field(default_factory=list)
    """The servers' messages for requests they rejected (4xx) in this round (their groups were dropped)."""
    dropped: list[RolloutGroup] = field(default_factory=list)
    """Finished groups not trained: their rewards are all equal (`rollout.dynamic_sampling`), or the
    teacher could not score them (`rollout.teacher.TeacherScorer.complete`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": [p.to_dict() for p in self.prompts], "groups": [g.to_dict() for g in self.groups],
                "metrics": dict(self.metrics), "rejections": list(self.rejections),
                "dropped": [g.to_dict() for g in self.dropped]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RolloutRound":
        return cls(prompts=[Prompt.from_dict(p) for p in d["prompts"]],
                   groups=[RolloutGroup.from_dict(g) for g in d["groups"]], metrics=dict(d.get("metrics", {})),
                   rejections=list(d.get("rejections", [])),
                   dropped=[RolloutGroup.from_dict(g) for g in d.get("dropped", [])])
