"""A host where the python tool's code cannot be isolated by the kernel, for real: a Python process
under a seccomp filter that refuses `unshare` (as where user namespaces are off, many SLURM
clusters) and installing another seccomp filter (as on a kernel or container without seccomp), so
both of the tool's kernel layers fail there with EPERM.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_DENY = '''
import sys
sys.path[:0] = [{root!r}, {tests!r}]
from megatron_bapo.rollout.tools import seccomp
seccomp.install(seccomp.assemble([seccomp.Rule("unshare"), seccomp.Rule("seccomp"),
                                  seccomp.Rule("prctl", arg0=seccomp.PR_SET_SECCOMP)]))
'''


def can_filter() -> bool:
    return platform.machine() in ("x86_64", "aarch64") and Path("/proc/self/status").read_text().count("Seccomp:") == 1


needs_seccomp = pytest.mark.skipif(not can_filter(), reason="needs Linux seccomp on x86_64 or aarch64")


def run_without_kernel_isolation(script: str, timeout_s: float = 300) -> str:
    """Run `script` (Python source) in a process whose children the kernel cannot isolate; its stdout
    (AssertionError with the output when it fails)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-c", _DENY.format(root=str(ROOT), tests=str(ROOT / "tests")) + script],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
