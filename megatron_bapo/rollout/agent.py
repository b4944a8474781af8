"""Multi-turn, tool-integrated rollouts: the agent loop, token in, token out.

A sample is a sequence of turns. After each model turn the loop parses the turn's tool calls
(`rollout.tool_calls`, Hermes/Qwen3 format by default), runs them (`rollout.tools`: sandboxed worker
processes with a timeout), appends the results as token ids, and lets the model continue, until a
turn has no call (the answer), `max_turns` model turns were taken, or the response budget
(`rollout.max_response_tokens`, tool tokens included) is used up.

Token in, token out: every request sends the exact ids of the prompt, the tokens sampled so far and
the tools' result ids; nothing generated is decoded and re-tokenized, so the tokens trained are the
tokens sampled. Tool tokens are recorded as such (`Sample.append_tool_tokens`): loss mask 0, no
log-prob, no version (docs/rollout.md#masks).

Partial rollout and rollout ahead: the partial-rollout manager gives each sample a budget of
`segment_tokens` SAMPLED tokens per round (`advance`); tool results do not use it. A round may
therefore end inside a model turn (the next round continues the turn) or right after a turn whose
calls have not run (they are kept in `AgentState.pending` and run first next round). Everything a
sample holds is JSON-safe state, checkpointed with the buffer, so a resumed run continues exactly.

A request comes back as a finished turn when the server stopped on a stop token or string, or when
its last token is one of the turn's stop ids even though the budget ended on it (SGLang reports
"length" then: the length check comes first). An abort (`client.abort_all`: a checkpoint or a
weight update pausing the round) ends a sample's round as it ends a segment: a turn in flight comes
back with its tokens, and a sample whose tool was running keeps the result and sends its next turn
in the next round (state ABORTED, resumed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Optional, Protocol, Sequence

from megatron_bapo.rollout.tool_calls import (ToolCall, ToolCallFormat, encode_text, parse_tool_calls, render_results,
                                              stop_params)
from megatron_bapo.rollout.tools import ToolDef, ToolOutcome, ToolRunner
from megatron_bapo.rollout.types import AgentState, GenerateResult, Sample, SampleState

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ToolConfig:
    """One tool the model may call (`rollout.agent.tools[]`)."""

    name: str
    """The name the model writes in its call (`{"name": ...}`)."""
    fn: str
    """"calculator", "python" or a plugin "package.module:function" (`rollout.tools`)."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments bound in the worker (e.g. the python tool's `cpu_s`, `memory_mb`); the model
    cannot set them."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"rollout.agent.tools[].name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"rollout.agent.tools[{self.name}].options must be a mapping, got {self.options!r}")


@dataclasses.dataclass
class AgentConfig:
    """`rollout.agent`: multi-turn rollouts with tools. No tools (the default): single-turn rollouts."""

    tools: list[ToolConfig] = dataclasses.field(default_factory=list)
    """The tools the model may call; empty = single-turn (one response per prompt, no agent loop)."""
    max_turns: int = 4
    """Model turns per sample at most (so `max_turns - 1` rounds of tool calls); a call written in
    the last allowed turn is not run and the sample ends (`AgentState.ended_by = "max_turns"`)."""
    max_calls_per_turn: int = 4
    """Calls run per turn; further calls of the turn get an error message (counted as errors)."""
    tool_timeout_s: float = 30.0
    """A call still running after this is killed with its worker; the model gets an error message."""
    num_tool_workers: int = 2
    """Worker processes per tool (calls of one tool run in parallel up to this many)."""
    max_result_chars: int = 1024
    """A tool's result is cut to this many characters (with a note) before it is tokenized."""
    allow_unisolated_python: bool = False
    """Run the built-in python tool even where the kernel cannot isolate its code (neither a network
    namespace nor a seccomp filter: docs/rollout.md#tools-as-sandboxed-plugins). Its code is then held
    back by the audit hook alone, which is best effort. False: such a run stops at start, in one line."""
    format: ToolCallFormat = dataclasses.field(default_factory=ToolCallFormat)
    """Call syntax and result wrapping (`rollout.tool_calls`)."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rollout.agent.tools has duplicate names {dupes}")
        if self.max_turns < 1:
            raise ValueError(f"rollout.agent.max_turns must be >= 1, got {self.max_turns}")
        if self.tools and self.max_turns < 2:
            raise ValueError(f"rollout.agent.max_turns={self.max_turns} leaves no turn after a tool call; use >= 2 "
                             f"or no rollout.agent.tools")
        for name in ("max_calls_per_turn", "num_tool_workers", "max_result_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.agent.{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.allow_unisolated_python, bool):
            raise ValueError(f"rollout.agent.allow_unisolated_python must be true or false, got "
                             f"{self.allow_unisolated_python!r}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"rollout.agent.tool_timeout_s must be > 0, got {self.tool_timeout_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.tools)


class TurnIO(Protocol):
    """What the loop may do with one sample (the partial-rollout manager's `_Turn`)."""

    async def generate(self, max_new_tokens: int) -> GenerateResult:
        """Sample up to `max_new_tokens` after all the sample's tokens; records them and sets `state`."""

    def room(self) -> int:
        """Tokens the sample may still add (response budget, context)."""

    def aborted(self) -> bool:
        """Whether the round was aborted since it began (`client.abort_all`)."""


class AgentLoop:
    """Advances multi-turn samples; stateless between calls (rollout and evaluation share one)."""

    COUNTERS = ("num_tool_calls", "num_tool_errors", "num_tool_timeouts", "num_tool_truncated", "num_tool_tokens",
                "tool_ms")
    """Per-round counters added to the manager's (`rollout/num_tool_*`; `tool_ms` is reported as `rollout/tool_s`)."""

    def __init__(self, config: AgentConfig, tokenizer: Any, runner: Optional[ToolRunner] = None) -> None:
        if not config.enabled:
            raise ValueError("AgentLoop needs at least one tool (rollout.agent.tools)")
        self.config, self.tokenizer, self.format = config, tokenizer, config.format
        self.runner = runner or ToolRunner([ToolDef(t.name, t.fn, dict(t.options)) for t in config.tools],
                                           timeout_s=config.tool_timeout_s, num_workers=config.num_tool_workers,
                                           max_result_chars=config.max_result_chars,
                                           allow_unisolated_python=config.allow_unisolated_python)
        self._stop = stop_params(tokenizer, self.format)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.turn_end_ids = frozenset(self._stop.get("stop_token_ids", [])) | ({int(eos)} if eos is not None else set())
        """Ids that end a turn when the budget ended on them too (module docstring)."""

    def close(self) -> None:
        self.runner.close()

    def request_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The sampling params of a request with the turn's stop at the call's end added."""
        out = dict(params)
        if "stop_token_ids" in self._stop:
            out["stop_token_ids"] = sorted(set(out.get("stop_token_ids") or []) | set(self._stop["stop_token_ids"]))
        if "stop" in self._stop:
            out["stop"] = list(out.get("stop") or []) + [s for s in self._stop["stop"] if s not in (out.get("stop") or [])]
        return out

    # ------------------------------------------------------------------ one round of one sample
    async def advance(self, s: Sample, io: TurnIO, budget: int, step: dict[str, int]) -> None:
        """Run the sample's turns and tool calls until it finishes, `budget` sampled tokens were
        generated, or a request is aborted; `s.state` says which (PARTIAL: resume next round)."""
        st = s.agent = s.agent or AgentState()
        if st.pending and not await self._run_tools(s, io, step):
            return
        while True:
            if io.aborted():  # aborted while a tool ran: the next turn is sent in the next round
                s.state = SampleState.ABORTED
                return
            n = min(budget, io.room())
            if n <= 0:
                if io.room() > 0:
                    s.state = SampleState.PARTIAL
                else:
                    s.state, st.ended_by = SampleState.TRUNCATED, "length"
                return
            before = len(s.response_ids)
            res = await io.generate(n)
            budget -= len(s.response_ids) - before
            if not self._turn_ended(s, res):
                if s.state is SampleState.TRUNCATED:
                    st.ended_by = "length"
                return  # PARTIAL (the round's budget), TRUNCATED (no room), ABORTED: as the manager set it
            calls = parse_tool_calls(self._decode(s.response_ids[st.turn_start:]), self.format)
            if not calls:
                s.state, st.ended_by = SampleState.COMPLETED, "answer"
                return
            if len(st.tool_spans) + 1 >= self.config.max_turns:
                s.state, st.ended_by = SampleState.COMPLETED, "max_turns"
                return
            st.pending = [c.to_dict() for c in calls]
            s.state = SampleState.PARTIAL
            if budget <= 0:
                return  # the round ends between the turn and its calls: they run first next round
            if not await self._run_tools(s, io, step):
                return

    def _turn_ended(self, s: Sample, res: GenerateResult) -> bool:
        if s.state is SampleState.COMPLETED:
            return True
        if s.state in (SampleState.PARTIAL, SampleState.TRUNCATED) and res.output_ids and \
                res.output_ids[-1] in self.turn_end_ids:
            # a server that checks length before stops (the built-in one did) calls this "length": the turn ended
            s.state = SampleState.COMPLETED
            return True
        return False

    async def _run_tools(self, s: Sample, io: TurnIO, step: dict[str, int]) -> bool:
        """Run the pending calls and append their results; False when the result does not fit (the
        sample is then truncated)."""
        st = s.agent
        calls = [ToolCall.from_dict(c) for c in st.pending]
        outcomes = await asyncio.gather(*(self._call(c, i) for i, c in enumerate(calls)))
        ids = encode_text(self.tokenizer, render_results([o.text for o in outcomes], self.format))
        st.pending = []
        for o in outcomes:
            st.num_tool_calls += 1
            st.num_tool_errors += o.status == "error"
            st.num_tool_timeouts += o.status == "timeout"
            st.num_tool_truncated += o.status == "truncated"
            st.tool_seconds += o.seconds
        step["num_tool_calls"] += len(outcomes)
        step["num_tool_errors"] += sum(o.status == "error" for o in outcomes)
        step["num_tool_timeouts"] += sum(o.status == "timeout" for o in outcomes)
        step["num_tool_truncated"] += sum(o.status == "truncated" for o in outcomes)
        step["tool_ms"] += int(round(1000 * sum(o.seconds for o in outcomes)))
        if len(ids) >= io.room():  # the result and at least one more model token must fit
            s.state, st.ended_by = SampleState.TRUNCATED, "no_room"
            return False
        s.append_tool_tokens(ids)
        st.turn_start = len(s.response_ids)
        step["num_tool_tokens"] += len(ids)
        s.state = SampleState.PARTIAL
        return True

    async def _call(self, call: ToolCall, index: int) -> ToolOutcome:
        if index >= self.config.max_calls_per_turn:
            return self.runner.error(f"error: more than {self.config.max_calls_per_turn} tool calls in one turn; "
                                     f"this one was not run")
        if call.error is not None:
            return self.runner.error(f"error: {call.error}")
        return await self.runner.call(call.name, call.arguments)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # ------------------------------------------------------------------ metrics
    def metrics(self, step: dict[str, int], finished: Sequence[Sample]) -> dict[str, float]:
        """`rollout/*` of one round: its tool calls, errors, timeouts and seconds, and per finished
        sample its turns, calls and sampled vs tool tokens."""
        out = {f"rollout/{k}": float(step.get(k, 0)) for k in self.COUNTERS if k != "tool_ms"}
        out["rollout/tool_s"] = step.get("tool_ms", 0) / 1000.0
        out.update(self.sample_metrics(finished))
        return out

    @staticmethod
    def sample_metrics(finished: Sequence[Sample]) -> dict[str, float]:
        """Per finished sample: turns, calls, sampled vs tool tokens (means; none without samples).
        `rollout.dynamic_sampling` takes them over all the groups a step finished, across its rounds."""
        out: dict[str, float] = {}
        if finished:
            states = [s.agent or AgentState() for s in finished]
            n = len(finished)
            out["rollout/turns_mean"] = sum(len(a.tool_spans) + 1 for a in states) / n
            out["rollout/tool_calls_per_sample"] = sum(a.num_tool_calls for a in states) / n
            out["rollout/tool_call_rate"] = sum(a.num_tool_calls > 0 for a in states) / n
            out["rollout/frac_max_turns"] = sum(a.ended_by == "max_turns" for a in states) / n
            tool = [a.num_tool_tokens for a in states]
            out["rollout/tool_tokens_mean"] = sum(tool) / n
            out["rollout/model_tokens_mean"] = sum(s.response_length - t for s, t in zip(finished, tool)) / n
        return out
