"""Agent tools: plugins the policy calls by name, each call in a sandboxed worker process.

A tool is a function `fn(**arguments) -> str` named by a built-in name or an import path
"package.module:function" (as reward plugins are). Built in:
- "calculator": arithmetic by safe AST evaluation, no `eval` (`rollout.tools.calculator`);
- "python": a Python interpreter in a subprocess with CPU-time, memory and output limits, kept off
  the network and from starting processes by the kernel where it allows (`rollout.tools.python`,
  `rollout.tools.isolation`). The runner checks once at start what this host gives it, logs it, and
  refuses to start when the kernel gives nothing, unless `rollout.agent.allow_unisolated_python`.

Every call runs in a long-lived worker process (the reward sandbox's `rewards.workers` pools, one
pool per tool) with a hard timeout. A call that raises, hangs past `timeout_s`, kills its worker or
returns more than `max_result_chars` becomes a short error message for the model, counted by
status ("error", "timeout", "truncated"); the run never dies of a tool. Options given in the config
(`rollout.agent.tools[].options`) are bound as keyword arguments in the worker; the model cannot
override them. The python tool's limits are bound even when the config leaves them at their
defaults: its only argument is the code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import time
from typing import Any, Callable, Optional, Sequence

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rewards import import_callable

logger = logging.getLogger(__name__)

BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "megatron_bapo.rollout.tools.calculator:calculator",
    "python": "megatron_bapo.rollout.tools.python:python",
}
"""Built-in tool name -> import path of its function."""

WORKER_MODULE = "megatron_bapo.rollout.tools.sandbox"
STATUSES = ("ok", "error", "timeout", "truncated")


class ToolSpecError(ValueError):
    """A tool spec cannot be resolved; the message names the spec and what to fix."""


class ToolIsolationError(ConfigError):
    """The python tool cannot be isolated by the kernel here and the config does not accept that."""


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

    def __init__(self, tools: Sequence[ToolDef], *, timeout_s: float, num_workers: int, max_result_chars: int,
                 allow_unisolated_python: bool = False) -> None:
        from megatron_bapo.rewards import workers

        self.timeout_s, self.max_result_chars = float(timeout_s), int(max_result_chars)
        self.tools = {t.name: t for t in tools}
        self.isolation = None
        """What the host gives the python tool's code (`isolation.Isolation`); None without a python tool."""
        for t in tools:
            load_tool_fn(t.fn)  # a bad spec fails here, naming it, not in every worker
        python_tools = [t.name for t in tools if resolve_tool_path(t.fn) == BUILTIN_TOOLS["python"]]
        if python_tools:
            self.isolation = _check_python_isolation(python_tools, allow_unisolated_python)
        self._pools = {}
        for t in tools:
            options = _worker_options(t, allow_unisolated_python)
            args = ("-m", WORKER_MODULE, resolve_tool_path(t.fn), json.dumps(options, sort_keys=True),
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


def _worker_options(tool: ToolDef, allow_unisolated_python: bool) -> dict:
    """The keyword arguments bound in `tool`'s workers. For the python tool: every limit (the config's
    or its default) and `allow_unisolated`, so the model can pass the code and nothing else."""
    if resolve_tool_path(tool.fn) != BUILTIN_TOOLS["python"]:
        return dict(tool.options)
    if "allow_unisolated" in tool.options:
        raise ToolSpecError(f"rollout.agent.tools[{tool.name}].options.allow_unisolated: set "
                            f"rollout.agent.allow_unisolated_python instead")
    from megatron_bapo.rollout.tools.python import python

    limits = {name: p.default for name, p in inspect.signature(python).parameters.items()
              if p.kind is p.KEYWORD_ONLY}
    return {**limits, **tool.options, "allow_unisolated": bool(allow_unisolated_python)}


def _check_python_isolation(names: Sequence[str], allowed: bool) -> Any:
    """What this host gives the python tool (one probe child), logged; ToolIsolationError when the
    kernel gives nothing and `allowed` is false."""
    from megatron_bapo.rollout.tools.isolation import probe

    got = probe()
    which = ", ".join(repr(n) for n in names)
    if got.kernel_isolated:
        logger.info("python tool %s isolation: %s", which, got.describe())
    elif allowed:
        logger.warning("python tool %s is NOT isolated by the kernel (%s): model-written code runs behind the audit "
                       "hook alone, which is best effort, as rollout.agent.allow_unisolated_python=true allows",
                       which, got.describe())
    else:
        raise ToolIsolationError(
            f"rollout.agent.tools: the python tool {which} cannot be isolated by the kernel on this host "
            f"({got.describe()}), so model-written code could reach the network and start processes; run where "
            f"unprivileged user namespaces or seccomp are allowed, or set rollout.agent.allow_unisolated_python=true "
            f"to accept the audit hook alone (best effort)")
    return got
