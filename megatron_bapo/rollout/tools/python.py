"""The built-in "python" tool: run a snippet in a fresh, limited Python subprocess and return its output.

The code runs as `python -I -S` (isolated: no user site, no environment paths) in an empty
temporary directory, in its own session, with:
- CPU time `cpu_s` (RLIMIT_CPU) and a wall-clock limit `wall_s` (the process group is killed);
- address space `memory_mb` (RLIMIT_AS; a MemoryError or a failed allocation);
- output `max_output_bytes`: stdout and stderr go to one file capped by RLIMIT_FSIZE, so printing
  megabytes fails there (EFBIG; Python ignores SIGXFSZ) instead of filling memory or a pipe;
- no network: a new network namespace with only a loopback that is down (unshare(2); as root, or
  where unprivileged user namespaces are allowed), and in any case an audit hook installed before the
  code runs that refuses sockets, new processes (fork, exec, subprocess, os.system) and ctypes;
- a SIGKILL when the worker that started it dies (PR_SET_PDEATHSIG), so nothing outlives a timeout.
The result is what the code printed (stdout and stderr interleaved; a traceback is ordinary output).
Hitting a limit raises `ToolError` with what was printed so far, so the call counts as failed.
Not a filesystem jail: the code runs as the trainer's user (in a temporary working directory that is
deleted afterwards, each file it writes capped at `max_output_bytes`); run untrusted code in a container.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile

from megatron_bapo.rollout.tools import ToolError

CLONE_NEWUSER, CLONE_NEWNET, PR_SET_PDEATHSIG = 0x10000000, 0x40000000, 1

# Runs inside the child before the user's code (read from stdin): the audit hook cannot be removed
# from Python, so the code cannot open a socket, start a process or load native code via ctypes.
BOOTSTRAP = r'''
import sys
_BLOCKED = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.", "ctypes.", "os.startfile")
def _hook(event, args):
    if event.startswith(_BLOCKED) or (event == "import" and args and args[0] in ("_ctypes", "ctypes")):
        what = f"import {args[0]}" if event == "import" else event
        raise PermissionError(f"{what} is not allowed in the python tool")
_code = sys.stdin.read()
sys.stdin = open("/dev/null")
sys.addaudithook(_hook)
del _hook
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
'''


def _limit(cpu_s: float, memory_mb: int, max_output_bytes: int) -> None:
    """In the child, before exec: resource limits, death with the parent, no network if possible."""
    cpu = max(1, int(cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_output_bytes + 1, max_output_bytes + 1))  # +1: "more than" is seen
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if libc.unshare(CLONE_NEWNET) != 0:  # root: a new network namespace; otherwise via a user namespace
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # refused where user namespaces are off: the hook remains


def python(code: str, *, cpu_s: float = 5.0, wall_s: float = 10.0, memory_mb: int = 512,
           max_output_bytes: int = 16384) -> str:
    """What `code` printed; ToolError when it exceeded a limit (module docstring)."""
    if not isinstance(code, str):
        raise ToolError(f"code must be a string, got {type(code).__name__}")
    with tempfile.TemporaryDirectory(prefix="python_tool_") as workdir:
        out_path = os.path.join(workdir, ".output")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", BOOTSTRAP], stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, cwd=workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True, preexec_fn=lambda: _limit(cpu_s, memory_mb, max_output_bytes))
            try:
                proc.communicate(code.encode("utf-8", "replace"), timeout=wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the session we started: the code and any child
                proc.wait()
                timed_out = True
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
