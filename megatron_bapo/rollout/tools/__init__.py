"""Agent tools: plugins the policy calls by name, each call in a sandboxed worker process.

A tool is a function `fn(**arguments) -> str` named by a built-in name or an import path
"package.module:function" (as reward plugins are). Built in:
- "calculator": arithmetic by safe AST evaluation, no `eval` (`rollout.tools.calculator`);
- "python": a Python interpreter in a subprocess with CPU-time, memory and output limits and no
  network (`rollout.tools.python`).

Every call runs in a long-lived worker process (the reward sandbox's `rewards.workers` pools, one
pool per tool) with a hard timeout. A call that raises, hangs past `timeout_s`, kills its worker or
returns more than `max_result_chars` becomes a short error message for the model, counted by
status ("error", "timeout", "truncated"); the run never dies of a tool. Options given in the config
(`rollout.agent.tools[].options`) are bound as keyword arguments in the worker; the model cannot
override them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from typing import Any, Callable, Optional, Sequence

from megatron_bapo.rewards import import_callable

BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "megatron_bapo.rollout.tools.calculator:calculator",
    "python": "megatron_bapo.rollout.tools.python:python",
}
"""Built-in tool name -> import path of its function."""

WORKER_MODULE = "megatron_bapo.rollout.tools.sandbox"
STATUSES = ("ok", "error", "timeout", "truncated")


class ToolSpecError(ValueError):
    """A tool spec cannot be resolved; the message names the spec and what to fix."""


class ToolError(Exception):
    """Raised by a tool to hand the model `str(exc)` as its result and count the call as failed
    (e.g. the Python tool when the code exceeds its CPU time or output limit)."""


def resolve_tool_path(spec: str) -> str:
    """"calculator" -> its import path; a "package.module:function" path is returned as is."""
    spec = spec.strip()
    return BUILTIN_TOOLS.get(spec, spec)


def load_tool_fn(spec: str) -> Callable[..., Any]:
    """Import the function of a built-in name or "package.module:function"; ToolSpecError names what is wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ToolSpecError(f"tool spec must be a non-empty string, got {spec!r}")
    return import_callable(spec, resolve_tool_path(spec), kind="tool", builtins=BUILTIN_TOOLS, error=ToolSpecError)


@dataclasses.dataclass
class ToolOutcome:
    """What one call gave the model: `text` (bounded) and how it went."""

    text: str
    status: str = "ok"
    """"ok", "error" (the tool raised, the call was malformed or named no tool, the worker died),
    "timeout" (still running after the timeout: killed) or "truncated" (the result was cut)."""
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class ToolDef:
    """One tool as the runner needs it (the config's `rollout.agent.tools[]` entry)."""

    name: str
    fn: str
    options: dict = dataclasses.field(default_factory=dict)


class ToolRunner:
    """Runs calls by tool name in worker processes (one `rewards.workers` pool per tool), each bounded
    by `timeout_s`; `await call(name, arguments)` never raises for a tool's failure."""

    def __init__(self, tools: Sequence[ToolDef], *, timeout_s: float, num_workers: int, max_result_chars: int) -> None:
        from megatron_bapo.rewards import workers

        self.timeout_s, self.max_result_chars = float(timeout_s), int(max_result_chars)
        self.tools = {t.name: t for t in tools}
        self._pools = {}
        for t in tools:
            load_tool_fn(t.fn)  # a bad spec fails here, naming it, not in every worker
            args = ("-m", WORKER_MODULE, resolve_tool_path(t.fn), json.dumps(t.options, sort_keys=True),
                    str(self.max_result_chars))
            self._pools[t.name] = workers.worker_pool(args, num_workers, f"tool {t.name}")
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, num_workers * len(tools)),
                                                               thread_name_prefix="tool")

    def error(self, message: str, status: str = "error", seconds: float = 0.0) -> ToolOutcome:
        return ToolOutcome(bound_text(message, self.max_result_chars)[0], status, seconds)

    async def call(self, name: Optional[str], arguments: Any) -> ToolOutcome:
        """Run tool `name` with keyword `arguments` (a dict) in its worker pool."""
        if name not in self._pools:
            return self.error(f"error: unknown tool {name!r}; available: {', '.join(sorted(self._pools))}")
        if not isinstance(arguments, dict):
            return self.error(f"error: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        reply, status = await loop.run_in_executor(self._executor, self._pools[name].call, {"arguments": arguments},
                                                   self.timeout_s)
        seconds = time.monotonic() - started
        if status == "timeout":
            return self.error(f"error: tool {name!r} still running after {self.timeout_s:g} s; stopped", "timeout", seconds)
        if status != "ok" or not isinstance(reply, dict) or reply.get("status") not in STATUSES:
            return self.error(f"error: tool {name!r} failed (its worker process died)", "error", seconds)
        text, cut = bound_text(str(reply.get("text", "")), self.max_result_chars)
        return ToolOutcome(text, "truncated" if cut and reply["status"] == "ok" else reply["status"], seconds)

    def close(self) -> None:
        """Stop the idle workers of every tool and the call threads."""
        for pool in self._pools.values():
            pool.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def bound_text(text: str, max_chars: int, *, total: Optional[int] = None) -> tuple[str, bool]:
    """`text` cut to at most `max_chars` characters, ending in a note of the full length (`total`,
    when `text` is already the kept head of a longer output); returns (text, whether it was cut)."""
    total = len(text) if total is None else max(total, len(text))
    if total <= max_chars:
        return text, False
    note = f"... [cut: {total} characters in all]"
    return (text[:max(0, max_chars - len(note))] + note)[:max_chars], True
