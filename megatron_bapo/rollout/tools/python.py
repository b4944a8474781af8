"""The built-in "python" tool: run a snippet in a fresh, limited Python subprocess and return its output.

The code runs as `python -I -S` (isolated: no user site, no environment paths) in an empty
temporary directory, in its own session, with:
- CPU time `cpu_s` (RLIMIT_CPU) and a wall-clock limit `wall_s` (the process group is killed);
- address space `memory_mb` (RLIMIT_AS; a MemoryError or a failed allocation);
- output `max_output_bytes`: stdout and stderr go to one file capped by RLIMIT_FSIZE, so printing
  megabytes fails there (EFBIG; Python ignores SIGXFSZ) instead of filling memory or a pipe;
- no network and no new processes, by the kernel where it allows (`rollout.tools.isolation`): a
  network namespace of its own, and a seccomp filter refusing new processes and sockets; behind them,
  an audit hook (`rollout.tools.guard`, best effort) refusing sockets, new processes (every way
  Python offers), ctypes and foreign native modules. Where the kernel gives neither layer the code is
  not run unless `allow_unisolated` (`rollout.agent.allow_unisolated_python`);
- a SIGKILL when the worker that started it dies (PR_SET_PDEATHSIG), and its whole process group is
  killed when it ends, so nothing outlives a call (a process the hook alone failed to stop included,
  unless it left the session).
The result is what the code printed (stdout and stderr interleaved; a traceback is ordinary output).
Hitting a limit raises `ToolError` with what was printed so far, so the call counts as failed.
Not a filesystem jail: the code runs as the trainer's user (in a temporary working directory that is
deleted afterwards, each file it writes capped at `max_output_bytes`); run untrusted code in a container.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_bapo.rollout.tools import ToolError
from megatron_bapo.rollout.tools.isolation import NotIsolated, spawn

PR_SET_PDEATHSIG = 1
BOOTSTRAP = Path(__file__).with_name("guard.py").read_text(encoding="utf-8")
"""The child's program (`python -I -S -c BOOTSTRAP`): the audit hook, then the code read from stdin."""


def _limit(cpu_s: float, memory_mb: int, max_output_bytes: int) -> None:
    """In the child, before exec: resource limits and death with the parent."""
    import ctypes

    cpu = max(1, int(cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_output_bytes + 1, max_output_bytes + 1))  # +1: "more than" is seen
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def python(code: str, *, cpu_s: float = 5.0, wall_s: float = 10.0, memory_mb: int = 512,
           max_output_bytes: int = 16384, allow_unisolated: bool = False) -> str:
    """What `code` printed; ToolError when it exceeded a limit, or when the kernel cannot isolate it
    and `allow_unisolated` is false (module docstring)."""
    if not isinstance(code, str):
        raise ToolError(f"code must be a string, got {type(code).__name__}")
    with tempfile.TemporaryDirectory(prefix="python_tool_") as workdir:
        out_path = os.path.join(workdir, ".output")
        with open(out_path, "wb") as out:
            try:
                proc, _ = spawn([sys.executable, "-I", "-S", "-c", BOOTSTRAP], required=not allow_unisolated,
                                before=lambda: _limit(cpu_s, memory_mb, max_output_bytes), stdin=subprocess.PIPE,
                                stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
            except NotIsolated as exc:
                raise ToolError(f"the code was not run: the kernel cannot isolate it here ({exc}) and "
                                f"rollout.agent.allow_unisolated_python is false") from None
            try:
                proc.communicate(code.encode("utf-8", "replace"), timeout=wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                timed_out = True
            finally:
                _kill_session(proc.pid)
        size = os.path.getsize(out_path)
        with open(out_path, "rb") as f:
            output = f.read(max_output_bytes).decode("utf-8", "replace")
    rc = proc.returncode
    if timed_out:
        raise ToolError(f"the code ran longer than {wall_s:g} s (wall clock); output so far:\n{output}")
    if rc == -signal.SIGXCPU or rc == -signal.SIGKILL:
        raise ToolError(f"the code used more than {cpu_s:g} s of CPU time; output so far:\n{output}")
    if rc == -signal.SIGXFSZ or size > max_output_bytes:  # CPython ignores SIGXFSZ: its writes fail (EFBIG)
        raise ToolError(f"the code printed more than {max_output_bytes} bytes; the first ones:\n{output}")
    if rc is not None and rc < 0:
        raise ToolError(f"the code was killed by {signal.Signals(-rc).name}; output so far:\n{output}")
    return output


def _kill_session(pid: int) -> None:
    """SIGKILL what is left of the process group (the session) the code was started in."""
    try:
        os.killpg(pid, signal.SIGKILL)  # the group we started (a pid naming a live group is not reused)
    except ProcessLookupError:
        pass
