"""A seccomp filter that makes the kernel refuse new processes and sockets (the python tool's code).

Built by hand (classic BPF, `prctl(PR_SET_SECCOMP)` through ctypes): no libseccomp binding is
needed. Unprivileged after `PR_SET_NO_NEW_PRIVS` (Linux >= 3.5), so it holds where user namespaces
are forbidden (many SLURM clusters), and, unlike the audit hook, whatever the code does inside the
interpreter (ctypes, a native extension, a corrupted interpreter): the filter stays on the process
and on any program it execs, and cannot be removed.

What the filter refuses, with EPERM unless said otherwise (x86_64 and aarch64; other architectures
get no filter: `assemble` says so):
- new processes: `fork`, `vfork`, and `clone` without CLONE_THREAD (threads still start); `clone3`
  with ENOSYS, as its flags sit behind a pointer, so glibc falls back to `clone`;
- sockets: `socket` (no network, no Unix socket), `io_uring_setup` (io_uring can open sockets);
- other processes' memory and file descriptors: `ptrace`, `process_vm_readv`/`writev`, `pidfd_getfd`;
- system calls of another ABI (32-bit x86, x32, arm32), which would bypass the numbers above.
Exec stays allowed (the interpreter is exec'd after the filter is installed); an exec'd program keeps
the filter, the rlimits and the namespace.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
OFF_NR, OFF_ARCH, OFF_ARG0 = 0, 4, 16  # struct seccomp_data; arg0's low word (little-endian)
CLONE_THREAD = 0x00010000
X32_SYSCALL_BIT = 0x40000000


@dataclass(frozen=True)
class Arch:
    audit: int
    """AUDIT_ARCH_* of the native ABI (seccomp_data.arch)."""
    nr: dict[str, int]
    """System call numbers by name."""


ARCHES = {
    "x86_64": Arch(0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "socket": 41, "ptrace": 101,
                                "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
                                "io_uring_setup": 425, "unshare": 272, "seccomp": 317, "prctl": 157}),
    "aarch64": Arch(0xC00000B7, {"clone": 220, "clone3": 435, "socket": 198, "ptrace": 117, "process_vm_readv": 270,
                                 "process_vm_writev": 271, "pidfd_getfd": 438, "io_uring_setup": 425, "unshare": 97,
                                 "seccomp": 277, "prctl": 167}),
}
"""Supported architectures (`platform.machine()`); aarch64 has no fork/vfork system calls."""

DENIED = ("fork", "vfork", "socket", "io_uring_setup", "ptrace", "process_vm_readv", "process_vm_writev",
          "pidfd_getfd")


@dataclass(frozen=True)
class Rule:
    """Refuse system call `name` with `errno`; only when its first argument equals `arg0` (if set), or
    unless it has one of the bits `unless_arg0_bits` (if set). The argument's low 32 bits are
    compared: exact for int arguments (`prctl`'s option) and `clone`'s flags."""

    name: str
    errno: int = 1  # EPERM
    arg0: Optional[int] = None
    unless_arg0_bits: Optional[int] = None


def process_rules() -> list[Rule]:
    """The python tool's rules (module docstring)."""
    return [Rule(n) for n in DENIED] + [Rule("clone", unless_arg0_bits=CLONE_THREAD), Rule("clone3", errno=38)]


def assemble(rules: Sequence[Rule], machine: Optional[str] = None) -> bytes:
    """The BPF program (struct sock_filter[]) refusing `rules` on `machine` (default: this one);
    every system call of another ABI is refused too. ValueError on an unsupported architecture."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"no seccomp filter for {machine!r} (only {sorted(ARCHES)})")
    arch = ARCHES[machine]
    prog: list[tuple[int, int, int, int]] = []  # (code, jt, jf, k); a jump skips jt/jf instructions
    deny_other_abi = (RET_K, 0, 0, RET_ERRNO | 1)
    prog += [(LD_W_ABS, 0, 0, OFF_ARCH), (JEQ_K, 1, 0, arch.audit), deny_other_abi, (LD_W_ABS, 0, 0, OFF_NR)]
    if machine == "x86_64":
        prog += [(JGE_K, 0, 1, X32_SYSCALL_BIT), deny_other_abi]
    for rule in rules:
        if rule.name not in arch.nr:
            continue  # e.g. fork on aarch64: the call does not exist there
        deny = (RET_K, 0, 0, RET_ERRNO | rule.errno)
        if rule.arg0 is None and rule.unless_arg0_bits is None:
            prog += [(JEQ_K, 0, 1, arch.nr[rule.name]), deny]
            continue
        allow = (RET_K, 0, 0, RET_ALLOW)
        if rule.arg0 is not None:  # arg0 == value: deny, else allow
            decide = [(JEQ_K, 0, 1, rule.arg0), deny, allow]
        else:  # arg0 has one of the bits: allow, else deny
            decide = [(JSET_K, 0, 1, rule.unless_arg0_bits), allow, deny]
        # a matched number always returns, so the number need not be reloaded for the next rule
        prog += [(JEQ_K, 0, 1 + len(decide), arch.nr[rule.name]), (LD_W_ABS, 0, 0, OFF_ARG0), *decide]
    prog.append((RET_K, 0, 0, RET_ALLOW))
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def install(program: bytes) -> None:
    """Install `program` on the calling thread (in a forked child before exec: the whole process).
    OSError naming the errno when the kernel refuses (no CONFIG_SECCOMP_FILTER, a filter denying it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("@HP", len(program) // 8, ctypes.addressof(buf))  # struct sock_fprog, native layout
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    for what, args in (("PR_SET_NO_NEW_PRIVS", (PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)),
                       ("PR_SET_SECCOMP", (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fbuf)))):
        if libc.prctl(*[ctypes.c_ulong(a) for a in args]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl({what}): {os.strerror(err)}")
