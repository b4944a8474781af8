"""Long-lived plugin subprocesses with hard timeouts: a stuck one is killed and replaced.

A reward check can hang in ways no signal interrupts (sympy's big-integer arithmetic in C, a
plugin waiting on a lock or the network), and `signal.alarm` works only in a main thread. So the
math reward (from worker threads), every plugin reward (`rewards.sandbox`) and every agent tool
(`rollout.tools.sandbox`) run in plain subprocesses (not `multiprocessing`: the parent's `__main__`
is never re-imported) that speak one JSON request per stdin line and one JSON reply per line of a
private pipe, after a first line "ready". The worker's file descriptor 1 is pointed at /dev/null
before any plugin runs, so whatever a plugin prints (`print`, a C library, a child process) cannot
corrupt the replies (`reply_channel`); a reply that is not JSON all the same counts as a dead worker.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
KILL_GRACE_S = 5.0


class WorkerProcess:
    """`python <args>`: one JSON-lines worker."""

    def __init__(self, args: Sequence[str], *, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.process = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, bufsize=1)
        first = self._readline(startup_timeout_s)
        if first != "ready":
            self.kill()
            raise RuntimeError(f"worker {' '.join(args)} did not start (first line {first!r})")

    def _readline(self, timeout_s: float) -> Optional[str]:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.process.stdout.readline()
        return line.strip() if line else None

    def call(self, request: dict, timeout_s: float) -> Optional[dict]:
        """The worker's reply, or None when it is stuck or dead (the caller then kills it)."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError:
            return None
        line = self._readline(timeout_s)
        if not line:
            return None
        try:
            return json.loads(line)
        except ValueError:  # not our worker's reply: treat it as broken (the caller kills it)
            logger.warning("worker %d wrote a line that is not a JSON reply: %r", self.process.pid, line[:200])
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # our own child, by its handle
        self.process.wait(timeout=KILL_GRACE_S)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class WorkerPool:
    """Up to `size` workers of one kind shared by all threads; `call` never hangs past its timeout."""

    def __init__(self, args: Sequence[str], size: int, name: str) -> None:
        self.args, self.size, self.name = list(args), size, name
        self._idle: "queue.Queue[WorkerProcess]" = queue.Queue()
        self._slots = threading.Semaphore(size)

    def call(self, request: dict, timeout_s: float) -> tuple[Optional[dict], str]:
        """(reply, "ok"), or (None, "timeout") for a worker still busy at the deadline (killed), or
        (None, "error") when no worker could answer (it died, or none would start)."""
        with self._slots:
            for _ in range(2):
                try:
                    worker = self._idle.get_nowait()
                except queue.Empty:
                    try:
                        worker = WorkerProcess(self.args)
                    except Exception as exc:  # noqa: BLE001
                        logger.error("cannot start a %s worker: %r", self.name, exc)
                        return None, "error"
                was_alive = worker.process.poll() is None
                reply = worker.call(request, timeout_s)
                if reply is not None:
                    self._idle.put(worker)
                    return reply, "ok"
                worker.kill()
                if was_alive and worker.process.returncode == -signal.SIGKILL:
                    return None, "timeout"  # we killed it: it was still working past the deadline
                # It had died on its own (OOM killer, a signal, a plugin calling exit): try once more.
                logger.warning("%s worker %d died (rc %s); replacing it", self.name, worker.process.pid,
                               worker.process.returncode)
            return None, "error"

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


_POOLS: dict[tuple, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def worker_pool(args: Sequence[str], size: int, name: str) -> WorkerPool:
    """The process-wide pool for these worker arguments and size."""
    key = (tuple(args), size)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = WorkerPool(args, size, name)
        return pool


def cleanup_workers() -> None:
    """Stop idle worker processes (also done at exit)."""
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


atexit.register(cleanup_workers)


def reply_channel():
    """Worker side: the file the replies go to (a duplicate of the original stdout), after fd 1 and
    `sys.stdout` were pointed at /dev/null, so that output of a plugin (Python or C level, or of
    its children, also while it is imported) never reaches the reply channel. Call it before
    importing the plugin."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = open(os.devnull, "w")
    return out


def serve(handle, out=None) -> None:
    """Worker side: 'ready', then `handle(request) -> reply` for every stdin line, the replies on
    `out` (`reply_channel()` when not given)."""
    out = out if out is not None else reply_channel()
    try:
        out.write("ready\n")
        out.flush()
        for line in sys.stdin:
            if not line.strip():
                continue
            reply: Any = handle(json.loads(line))
            out.write(json.dumps(reply) + "\n")
            out.flush()
    except BrokenPipeError:
        # The trainer that reads the replies is gone (killed, or stopped with the run): nothing is
        # left to answer, and a traceback would land on the trainer's terminal after its last line.
        os._exit(0)
