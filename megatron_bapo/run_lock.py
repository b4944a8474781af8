"""One run per `trainer.output_dir`: a lock file taken before the run writes anything there.

    lock = RunLock.acquire(output_dir)     # LockError naming the holder when another run has it
    ...                                    # the run
    lock.release()

The same job started twice on one directory (a double `sbatch`, a resume started while the first
job still runs) would otherwise train twice into it: both log the same steps, interleave
`samples.jsonl` and overwrite each other's checkpoints. The second start is refused in one line
naming the holder (host, pid, start time) instead.

How, on a shared file system (NFS, Lustre) as on a local disk: the holder's description is written
to a private temporary file, which is then hard-linked to `<output_dir>/run.lock`. `link` is atomic
and fails when the name exists, on NFS too (O_EXCL is not reliable on old NFS clients), so exactly
one starter wins and the file is never seen half written.

A lock whose holder is gone is taken over with one log line:
- same host: the recorded pid is not running, or runs another process (its start time in
  /proc differs from the recorded one: the pid was reused);
- another host: liveness cannot be checked from here, so the holder refreshes the file's mtime
  every `HEARTBEAT_S` seconds and a lock not refreshed for `STALE_AFTER_S` is stale (a node that
  crashed).

Taking over is where several starters race (a stale lock, then a double `sbatch`): removing the
stale file and linking a new one lets a slow starter remove the lock a fast one has just taken.
So a stale lock is never removed. Its successor is claimed instead: `run.lock.next-<digest>`, named
after the stale file's content (sha1), created by the same exclusive `link`, so exactly one starter
claims each stale lock. The claimant checks that `run.lock` still holds that content and only then
`rename`s its claim onto `run.lock` (atomic, on NFS too). Nobody else can change `run.lock` between
the check and the rename: it exists (no fresh link succeeds) and its holder is gone (no release),
and only the one claimant of its content may replace it. A starter that claims after the winner
renamed finds other content in `run.lock`, drops its claim and sees the winner's live lock. A claim
left by a starter that died is itself stale (same rules) and is taken over the same way, by a claim
on the claim. Only `link` and `rename` are relied on: no `flock`, which NFS mounted `nolock` and
Lustre mounted `localflock` keep per node, and Lustre `noflock` refuses.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
"""How often the holder refreshes the lock's mtime (a daemon thread)."""
STALE_AFTER_S = 600.0
"""A lock of another host not refreshed for this long is stale; 20 heartbeats, so clock skew
between hosts and a slow file server cannot make a live run's lock look stale."""


class LockError(RuntimeError):
    """Another run holds the output directory; the message names it and the ways out."""


def _process_start(pid: int) -> Optional[str]:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), or None
    when it does not run (or /proc is unavailable). With the pid, it names one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
    if fields and fields[0] == "Z":  # a zombie has exited
        return None
    return fields[19] if len(fields) > 19 else None


def _running(pid: int, start: Optional[str]) -> bool:
    """Whether the process `pid` (started at `start`, when recorded) still runs on this host."""
    now = _process_start(pid)
    if now is not None:
        return start is None or now == start
    if Path("/proc/self/stat").exists():
        return False  # no such process, or a zombie
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RunLock:
    path: Path
    holder: dict[str, Any]
    _stop: threading.Event
    _thread: Optional[threading.Thread] = None
    took_over: Optional[str] = None
    """Set when a stale lock was taken over: the line to log (`logs` is configured after the lock)."""

    @classmethod
    def acquire(cls, output_dir: str | Path) -> "RunLock":
        """Take `<output_dir>/run.lock` (creating the directory), or raise `LockError`."""
        root = Path(output_dir)
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_NAME
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": uuid.uuid4().hex}
        took_over = None
        for _ in range(5):
            if _link_new(path, holder):
                break
            other, digest = _read(path)
            if other is None:  # released between our link and the read: try again
                continue
            why = _stale(path, other)
            if why is None:
                raise LockError(_refusal(path, other))
            if _take_over(path, digest, holder, depth=0):
                took_over = f"took over the lock {path} of the run ({_describe(other)}): {why}"
                break
        else:
            raise LockError(f"could not take the lock {path}: it keeps changing (several runs starting on "
                            f"trainer.output_dir={str(root)!r} at once?)")
        lock = cls(path, holder, threading.Event(), took_over=took_over)
        lock._start_heartbeat()
        return lock

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        self._thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Remove the lock if it is still this run's (never another run's that took over)."""
        self._stop.set()
        current, _ = _read(self.path)
        if current is not None and current.get("token") == self.holder["token"]:
            self.path.unlink(missing_ok=True)


MAX_CLAIM_DEPTH = 3
"""Claims on claims followed at most (each level needs another starter that died mid-takeover)."""


def _take_over(target: Path, digest: str, holder: dict[str, Any], *, depth: int) -> bool:
    """Replace `target`, whose content (sha1 `digest`) belongs to a holder that is gone, by a file
    describing `holder`; True when this starter did, False when another one did or `target` changed
    (the caller looks again). Raises `LockError` when a live starter is taking it over right now."""
    claim = target.with_name(f"{LOCK_NAME}.next-{digest}")
    if not _link_new(claim, holder):
        claimant, claim_digest = _read(claim)
        if claimant is None:  # the claimant renamed or dropped it meanwhile
            return False
        if _stale(claim, claimant) is None:
            if _read(target)[1] != digest:  # it already won (or lost): look again, to name the holder
                return False
            raise LockError(_refusal(target.parent / LOCK_NAME, claimant))  # it is taking over now: it will hold
        if depth >= MAX_CLAIM_DEPTH or not _take_over(claim, claim_digest, holder, depth=depth + 1):
            return False
    # The claim is ours: `target` can now change only through it.
    _, current = _read(target)
    if current != digest:
        claim.unlink(missing_ok=True)
        return False
    os.rename(claim, target)
    return True


def _link_new(path: Path, holder: dict[str, Any]) -> bool:
    tmp = path.with_name(f"{LOCK_NAME}.{holder['token']}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(holder, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> tuple[Optional[dict[str, Any]], str]:
    """(the holder `path` describes, the sha1 of its bytes); (None, "") when it does not exist. The
    digest names one write of the file: every holder's description holds a fresh token."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, ""
    except OSError:
        return dict(UNREADABLE), "unreadable"
    digest = hashlib.sha1(raw).hexdigest()
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError:
        return dict(UNREADABLE), digest
    return (data if isinstance(data, dict) else dict(UNREADABLE)), digest


UNREADABLE = {"host": "?", "pid": -1, "started": "?", "token": "unreadable"}


def _stale(path: Path, holder: dict[str, Any]) -> Optional[str]:
    """Why the lock's holder is gone, or None when it may still run."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "it was removed"
    if holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", -1))
        if pid > 0 and not _running(pid, holder.get("process_start")):
            return f"pid {pid} no longer runs on this host"
        return None
    if age > STALE_AFTER_S:
        return f"not refreshed for {age:.0f} s (its holder refreshes it every {HEARTBEAT_S:.0f} s)"
    return None


def _describe(holder: dict[str, Any]) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def _refusal(path: Path, holder: dict[str, Any]) -> str:
    root = path.parent
    return (f"trainer.output_dir={str(root)!r} is in use by another run ({_describe(holder)}; its lock {path}); "
            f"wait for it to end or stop it, or use another trainer.output_dir (a lock of a run that is gone is taken "
            f"over: on this host at once, from another host {STALE_AFTER_S:.0f} s after its last refresh)")
