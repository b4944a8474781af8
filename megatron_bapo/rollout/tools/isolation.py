"""What the kernel enforces around the python tool's code, set up in its process before exec.

Two layers, each tried in the forked child (`isolate_child`), each reported back to the parent
through a pipe (`spawn` returns what the child got, as an `Isolation`):
- a network namespace of its own, with only a loopback that is down (`unshare(CLONE_NEWNET)` as
  root, else inside a new user namespace; refused where user namespaces are off, as on many SLURM
  clusters): no network, whatever the code does;
- a seccomp filter (`rollout.tools.seccomp`): new processes and sockets refused by the kernel,
  whatever the code does. Needs no privilege; x86_64 and aarch64.
The code is "isolated by the kernel" when it has either: both take the network away; the filter
also refuses new processes. Without either, only the audit hook (`rollout.tools.guard`, best
effort) stands between the code and the network, so the child refuses to exec unless the caller
allows it (`rollout.agent.allow_unisolated_python`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence

from megatron_bapo.rollout.tools import seccomp

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What one child got (or, from `probe`, what this host gives)."""

    netns: Optional[str] = None
    """"own" (root), "own, in a user namespace", or None: the host's network."""
    netns_error: str = ""
    seccomp: bool = False
    """Whether the filter refusing new processes and sockets is on."""
    seccomp_error: str = ""

    @property
    def kernel_isolated(self) -> bool:
        """The kernel keeps the code off the network (and, with the filter, refuses it new processes)."""
        return self.netns is not None or self.seccomp

    def describe(self) -> str:
        """One line for the log: each layer, on or off and why."""
        net = f"network namespace: {self.netns}" if self.netns else f"no network namespace ({self.netns_error})"
        filt = ("seccomp filter: new processes and sockets refused by the kernel" if self.seccomp
                else f"no seccomp filter ({self.seccomp_error})")
        return f"{net}; {filt}; audit hook: on (best effort)"


class NotIsolated(RuntimeError):
    """The child found no kernel isolation and was not allowed to run without it; nothing ran."""

    def __init__(self, isolation: Isolation) -> None:
        super().__init__(isolation.describe())
        self.isolation = isolation


@functools.lru_cache(maxsize=1)
def filter_program() -> tuple[Optional[bytes], str]:
    """(the seccomp program of this machine, "") or (None, why there is none); built once, in the parent."""
    try:
        return seccomp.assemble(seccomp.process_rules()), ""
    except ValueError as exc:
        return None, str(exc)


def isolate_child(program: Optional[bytes], program_error: str, report_fd: int, required: bool) -> None:
    """In the forked child, before exec: a network namespace, then the seccomp filter, then the
    report on `report_fd` (closed after: the code never sees it). Raises when `required` and the
    child got neither (the exec does not happen)."""
    libc = ctypes.CDLL(None, use_errno=True)
    netns, netns_error = None, ""
    if libc.unshare(CLONE_NEWNET) == 0:
        netns = "own"
    elif libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        netns = "own, in a user namespace"
    else:
        netns_error = f"unshare: {os.strerror(ctypes.get_errno())}"
    on, seccomp_error = False, program_error
    if program is not None:
        try:
            seccomp.install(program)
            on = True
        except OSError as exc:
            seccomp_error = exc.strerror or str(exc)
    got = Isolation(netns, netns_error, on, seccomp_error)
    os.write(report_fd, json.dumps(dataclasses.asdict(got)).encode())
    os.close(report_fd)
    if required and not got.kernel_isolated:
        raise PermissionError("no kernel isolation")


def spawn(argv: Sequence[str], *, required: bool, before: Optional[Callable[[], None]] = None,
          **popen: Any) -> tuple[subprocess.Popen, Isolation]:
    """`subprocess.Popen(argv, **popen)` isolated by `isolate_child` (after `before`, e.g. rlimits,
    in the child); returns the process and what it got. `NotIsolated` when `required` and the child
    got no kernel isolation (it never exec'd)."""
    program, program_error = filter_program()
    r, w = os.pipe()

    def preexec() -> None:
        if before is not None:
            before()
        isolate_child(program, program_error, w, required)

    try:
        try:
            proc = subprocess.Popen(list(argv), pass_fds=(w,), preexec_fn=preexec, **popen)
        except subprocess.SubprocessError:  # the child raised before exec
            os.close(w)
            w = -1
            got = _read_report(r)
            if got is not None and required and not got.kernel_isolated:
                raise NotIsolated(got) from None
            raise
        os.close(w)
        w = -1
        got = _read_report(r)
        if got is None:  # cannot happen: the child writes its report before exec
            proc.kill()
            proc.wait()
            raise RuntimeError("the python tool's child exec'd without reporting its isolation")
        return proc, got
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)


def _read_report(fd: int) -> Optional[Isolation]:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return Isolation(**json.loads(b"".join(chunks))) if chunks else None


def probe() -> Isolation:
    """What this host gives the python tool's code (an empty child, isolated as a call's would be)."""
    proc, got = spawn([sys.executable, "-I", "-S", "-c", ""], required=False, stdin=subprocess.DEVNULL,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    proc.wait()
    return got
