"""The python tool's sandbox (`rollout.tools.python`, `guard`, `isolation`, `seccomp`): every way
Python offers to start a process is refused, by each layer on its own, with real children:
- the tool as this host runs it (kernel layers where the host allows them, then the audit hook);
- the audit hook alone: the tool in a process where the kernel refuses both of its layers
  (`sandbox_helpers`), run because `allow_unisolated` says so;
- the kernel alone: plain code (no hook) in a child isolated by `isolation.spawn`.
Without kernel isolation the tool refuses to run code unless allowed, and says so at start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap

import pytest

from sandbox_helpers import needs_seccomp, run_without_kernel_isolation
from megatron_bapo.rollout.tools import ToolDef, ToolRunner
from megatron_bapo.rollout.tools.python import BOOTSTRAP, python

FORK_EXEC = """
import _posixsubprocess
r, w = os.pipe()
args = ([b"/bin/echo", b"ESCAPED"], [b"/bin/echo"], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False,
        -1, None, None, None, -1, None)
try:
    pid = _posixsubprocess.fork_exec(*args, False)
except TypeError:  # a Python without fork_exec's allow_vfork argument
    pid = _posixsubprocess.fork_exec(*args)
os.waitpid(pid, 0)
"""
LIBC_FORK = """
import ctypes
libc = {load}
pid = libc.fork()
if pid == 0:
    libc.write(1, b"ESCAPED\\n", 8)
    libc._exit(0)
if pid < 0:
    libc.__errno_location.restype = ctypes.POINTER(ctypes.c_int)
    raise OSError({errno}, "libc fork")
os.waitpid(pid, 0)
"""
FORK_CHILD_PRINTS = """
if pid == 0:
    print("ESCAPED", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""
PTY_CHILD_PRINTS = """
if pid == 0:
    print("ESCAPED", flush=True)
    os._exit(0)
print(os.read(fd, 100).decode(), flush=True)
os.waitpid(pid, 0)
"""
MULTIPROCESSING = """
import multiprocessing
p = multiprocessing.get_context({method!r}).Process(target=print, args=("ESCAPED",))
p.start()
p.join()
"""
PATHS = {
    "os.fork": "pid = os.fork()" + FORK_CHILD_PRINTS,
    "os.forkpty": "pid, fd = os.forkpty()" + PTY_CHILD_PRINTS,
    "pty.fork": "import pty\npid, fd = pty.fork()" + PTY_CHILD_PRINTS,
    "os.posix_spawn": "os.waitpid(os.posix_spawn('/bin/echo', ['echo', 'ESCAPED'], {}), 0)",
    "os.posix_spawnp": "os.waitpid(os.posix_spawnp('echo', ['echo', 'ESCAPED'], {'PATH': '/usr/bin:/bin'}), 0)",
    "_posixsubprocess.fork_exec": FORK_EXEC,
    "subprocess.run": "import subprocess\nsubprocess.run(['echo', 'ESCAPED'])",
    "os.system": "rc = os.system('echo ESCAPED')\nif rc:\n    raise OSError(f'os.system returned {rc}')",
    "os.spawnv": "os.spawnv(os.P_WAIT, '/bin/echo', ['echo', 'ESCAPED'])",
    "os.execv": "os.execv('/bin/echo', ['echo', 'ESCAPED'])",
    "ctypes.CDLL fork": LIBC_FORK.format(load="ctypes.CDLL(None, use_errno=True)", errno="ctypes.get_errno()"),
    "ctypes.cdll fork": LIBC_FORK.format(load="ctypes.cdll.LoadLibrary('libc.so.6')",
                                         errno="libc.__errno_location().contents.value"),
    "ctypes socket": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
                      "if fd < 0:\n    raise OSError(ctypes.get_errno(), 'libc socket')\nprint('ESCAPED: socket')"),
    "multiprocessing fork": MULTIPROCESSING.format(method="fork"),
    "multiprocessing spawn": MULTIPROCESSING.format(method="spawn"),
    "multiprocessing forkserver": MULTIPROCESSING.format(method="forkserver"),
    "socket": "import socket\nsocket.socket()\nprint('ESCAPED: socket')",
    "importlib _posixsubprocess": ("import importlib\nimportlib.import_module('_posixsubprocess')\n"
                                   "print('ESCAPED: import')"),
    "sys.modules _posixsubprocess": ("import importlib\nsys.modules.pop('_posixsubprocess', None)\n"
                                     "importlib.import_module('_posixsubprocess')\nprint('ESCAPED: import')"),
    "native module from another file": """
import importlib.util
dynload = next(d for d in sys.path if d.endswith("lib-dynload"))
os.symlink(os.path.join(dynload, next(f for f in os.listdir(dynload) if f.startswith("_bisect."))), "mine.so")
importlib.util.module_from_spec(importlib.util.spec_from_file_location("_bisect", os.path.abspath("mine.so")))
print("ESCAPED: loaded")
""",
}
"""Each prints ESCAPED when it got a new process (or a socket, or the module) and REFUSED when refused."""
NOT_KERNEL = {"os.execv", "importlib _posixsubprocess", "sys.modules _posixsubprocess",
              "native module from another file"}
"""What the kernel layer allows by design: exec (the same process, filter and limits kept) and imports."""


def wrap(body: str) -> str:
    return (f"import os, sys\ntry:\n{textwrap.indent(body.strip(), '    ')}\nexcept BaseException as exc:\n"
            f"    print('REFUSED', type(exc).__name__, exc, flush=True)\n")


def refused_by_hook(out: str) -> bool:
    return "ESCAPED" not in out and "REFUSED" in out and "is not allowed in the python tool" in out


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_tool_refuses_every_way_to_start_a_process(path):
    out = python(wrap(PATHS[path]))
    assert refused_by_hook(out), out


@pytest.fixture(scope="module")
def unisolated():
    """One process where the kernel cannot isolate the tool's children: what the tool did there."""
    script = f"""
import asyncio, json, logging
from megatron_bapo.rollout.tools import ToolDef, ToolRunner
from megatron_bapo.rollout.tools.python import python
PATHS = json.loads({json.dumps(json.dumps({k: wrap(v) for k, v in PATHS.items()}))})
out = {{}}
def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = f"{{type(exc).__name__}}: {{exc}}"
attempt("default", lambda: python("print('RAN')"))
attempt("allowed", lambda: python("print('RAN')", allow_unisolated=True))
for name, code in PATHS.items():
    attempt(name, lambda: python(code, allow_unisolated=True))
def refused_runner():
    ToolRunner([ToolDef("py", "python")], timeout_s=30, num_workers=1, max_result_chars=2000).close()
    return "started"
attempt("runner", refused_runner)
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append(r.getMessage())
logging.getLogger("megatron_bapo.rollout.tools").addHandler(handler)
logging.getLogger("megatron_bapo.rollout.tools").setLevel(logging.INFO)
def allowed_runner():
    runner = ToolRunner([ToolDef("py", "python")], timeout_s=30, num_workers=1, max_result_chars=2000,
                        allow_unisolated_python=True)
    try:
        return asyncio.run(runner.call("py", {{"code": "import _posixsubprocess"}})).text
    finally:
        runner.close()
attempt("allowed_runner", allowed_runner)
out["log"] = records
print(json.dumps(out))
"""
    return json.loads(run_without_kernel_isolation(script).strip().splitlines()[-1])


@needs_seccomp
def test_without_kernel_isolation_the_code_is_not_run_unless_allowed(unisolated):
    assert unisolated["default"].startswith("ToolError: the code was not run: the kernel cannot isolate it here (no "
                                            "network namespace (unshare: Operation not permitted); no seccomp filter "
                                            "(prctl(PR_SET_SECCOMP): Operation not permitted)"), unisolated["default"]
    assert "rollout.agent.allow_unisolated_python is false" in unisolated["default"]
    assert unisolated["allowed"] == "RAN\n"
    assert unisolated["runner"].startswith("ToolIsolationError: rollout.agent.tools: the python tool 'py' cannot be "
                                           "isolated by the kernel on this host"), unisolated["runner"]
    assert "set rollout.agent.allow_unisolated_python=true" in unisolated["runner"]
    assert "import _posixsubprocess is not allowed in the python tool" in unisolated["allowed_runner"]
    assert any("NOT isolated by the kernel" in line and "audit hook alone" in line for line in unisolated["log"])


@needs_seccomp
@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_audit_hook_alone_refuses_every_way_to_start_a_process(path, unisolated):
    assert refused_by_hook(unisolated[path]), unisolated[path]


@needs_seccomp
@pytest.mark.parametrize("path", sorted(set(PATHS) - NOT_KERNEL))
def test_the_kernel_alone_refuses_every_way_to_start_a_process(path):
    from megatron_bapo.rollout.tools.isolation import spawn

    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryFile() as out:
        proc, got = spawn([sys.executable, "-I", "-S", "-c", wrap(PATHS[path])], required=True,
                          stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                          start_new_session=True)
        proc.wait(timeout=120)
        out.seek(0)
        text = out.read().decode()
    assert got.seccomp, got
    assert "ESCAPED" not in text and "REFUSED" in text, text
    assert "[Errno 1]" in text or "os.system returned" in text, text


def test_code_runs_when_a_refused_module_was_loaded_before_the_hook_never():
    """Loaded modules cannot be taken back (`subprocess` holds `fork_exec`, reachable from its classes):
    the guard refuses to run any code then, rather than trust a scrubbed `sys.modules`."""
    for preload in ("import _posixsubprocess", "__import__('subprocess')", "__import__('ctypes')"):
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", f"{preload}\n{BOOTSTRAP}"], input="print('RAN')",
                              capture_output=True, text=True, timeout=60)
        assert "RAN" not in proc.stdout and proc.returncode != 0, (preload, proc.stdout, proc.stderr)
        assert "loaded before the audit hook; refusing to run the code" in proc.stderr, (preload, proc.stderr)


@needs_seccomp
def test_the_runner_logs_the_isolation_it_got_and_threads_still_run(caplog):
    caplog.set_level("INFO", logger="megatron_bapo.rollout.tools")
    runner = ToolRunner([ToolDef("py", "python")], timeout_s=30, num_workers=1, max_result_chars=2000)
    try:
        assert runner.isolation.seccomp and runner.isolation.kernel_isolated
        assert any("python tool 'py' isolation: " in r.getMessage() and "seccomp filter: new processes and sockets "
                   "refused by the kernel; audit hook: on (best effort)" in r.getMessage() for r in caplog.records)
    finally:
        runner.close()
    code = "import threading\nt = threading.Thread(target=print, args=('thread ran',))\nt.start()\nt.join()"
    assert python(code) == "thread ran\n"
