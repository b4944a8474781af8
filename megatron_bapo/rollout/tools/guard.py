"""The python tool's bootstrap: an audit hook, then the model's code (read from stdin).

Run as `python -I -S -c <this file's source>` (`rollout.tools.python`); stdlib only, as the child
cannot import the package. The hook (PEP 578) refuses, with a PermissionError naming what:
- new processes: `os.fork`, `os.forkpty` (so `pty.fork`), `os.posix_spawn`/`posix_spawnp`,
  `os.system`, `os.exec*`, `os.spawn*` (fork underneath), `subprocess.Popen`;
- `_posixsubprocess` (whose `fork_exec` raises no audit event: `subprocess` and `multiprocessing`
  start processes through it), `multiprocessing`, `ctypes`/`_ctypes`, and every `ctypes.*` event
  (dlopen, dlsym, each foreign call), so no libc `fork`/`execve`/`socket` either;
- a native extension from anywhere but the interpreter's own lib-dynload (code could write one),
  and CPython's test extensions (`_testcapi`, `_testinternalcapi`, ...: they corrupt memory on demand);
- sockets (`socket.*`), `os.kill`/`killpg`, and `gc.get_objects`/`get_referrers`/`get_referents`
  (a way to objects the hook cannot see).
Modules already loaded cannot be taken back (their functions may be referenced anywhere), so when
one of the refused modules is loaded before the hook, no code runs at all. A fresh `-I -S`
interpreter loads none of them.

Best effort, by design of audit hooks (PEP 578: "not a sandbox"): code that corrupts the
interpreter's memory (a CPython bug, /proc/self/mem) runs on without the hook. What holds whatever
the code does is the kernel's part (`rollout.tools.seccomp`, a network namespace).
"""

import sys

BLOCKED_EVENTS = ("os.fork", "os.forkpty", "os.posix_spawn", "os.system", "os.exec", "os.spawn", "os.startfile",
                  "subprocess.Popen", "pty.", "ctypes.", "socket.", "os.kill", "os.killpg", "gc.get_objects",
                  "gc.get_referrers", "gc.get_referents")
BLOCKED_MODULES = frozenset({"_posixsubprocess", "subprocess", "multiprocessing", "_multiprocessing", "_posixshmem",
                             "ctypes", "_ctypes", "_ctypes_test"})
BLOCKED_PREFIX = "_test"  # _testcapi, _testinternalcapi, _testbuffer, ...


def install() -> None:
    """Add the hook (it cannot be removed). Everything it reads is bound here, in its closure: the
    code can reach this module's globals and `builtins`, not the hook function."""
    loaded = sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED_MODULES or n.startswith(BLOCKED_PREFIX))
    if loaded:
        raise SystemExit(f"python tool: {', '.join(loaded)} loaded before the audit hook; refusing to run the code")
    import os

    events, modules, prefix, join = tuple(BLOCKED_EVENTS), frozenset(BLOCKED_MODULES), str(BLOCKED_PREFIX), "".join
    native = {}  # module name -> the one file it may be loaded from
    for d in sys.path:
        if os.path.basename(d) == "lib-dynload" and os.path.isdir(d):
            native.update({f.partition(".")[0]: os.path.join(d, f) for f in os.listdir(d) if f.endswith(".so")})
    denied, is_instance, length, text = PermissionError, isinstance, len, str  # `builtins` can be patched

    def hook(event, args):
        what = None
        if event.startswith(events):
            what = event
        elif event == "import":
            name = join((args[0],))  # an exact str of its characters: a str subclass's methods are not trusted
            if name.partition(".")[0] in modules or name.startswith(prefix):
                what = f"import {name}"
            elif length(args) > 1 and args[1] is not None:  # a native extension is being loaded from a file
                path = join((args[1],)) if is_instance(args[1], text) else None
                if path is None or native.get(name) != path:
                    what = f"loading the native module {name} from {path!r}"
        if what is not None:
            raise denied(f"{what} is not allowed in the python tool")

    sys.addaudithook(hook)


def main() -> None:
    code = sys.stdin.read()
    sys.stdin = open("/dev/null")
    install()
    exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main()
