"""`RunLock.acquire` under concurrent takeovers of a stale lock: exactly one starter holds the
output directory each time, however the starters interleave (`megatron_bapo.run_lock`).

Eight real processes (forked once, reused every round) wait on one barrier and call
`RunLock.acquire` on the same directory at the same instant, over a lock left by a run that is gone
(its pid now names another process); every other round also over the claim a starter that died
mid-takeover left on it. A holder keeps the lock until every starter has answered, so a second
success cannot be a legitimate take after a release.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest

NUM_STARTERS = 8
NUM_ROUNDS = 150
WAIT_S = 60.0  # a barrier not reached in this long means a starter hung: the test fails, it does not hang


def _starter(root: str, barrier, results, rounds: int) -> None:
    from megatron_bapo.run_lock import LockError, RunLock

    for i in range(rounds):
        barrier.wait(WAIT_S)  # the parent wrote round i's stale lock
        lock, outcome = None, "refused"
        try:
            lock = RunLock.acquire(Path(root) / f"round{i}")
            outcome = "held"
        except LockError:
            pass
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the round
            outcome = f"{type(exc).__name__}: {exc}"
        results.put((i, os.getpid(), outcome))
        barrier.wait(WAIT_S)  # every starter answered: only now may the holder let go
        if lock is not None:
            lock.release()
        barrier.wait(WAIT_S)


def _gone(token: str) -> bytes:
    """A holder of this host whose pid now runs another process (the recorded start time differs)."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "process_start": "1",
                       "started": "long ago", "token": token}).encode()


def _write_stale_lock(out: Path, *, dead_claim: bool = False) -> None:
    """A lock left by a run that is gone; with `dead_claim`, also the claim on it (`run.lock.next-<sha1>`)
    of a starter that died while taking it over."""
    out.mkdir()
    (out / "run.lock").write_bytes(_gone("gone"))
    if dead_claim:
        (out / f"run.lock.next-{hashlib.sha1(_gone('gone')).hexdigest()}").write_bytes(_gone("died-claiming"))


def test_concurrent_takeovers_of_a_stale_lock_leave_exactly_one_holder(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(NUM_STARTERS + 1), ctx.Queue()
    starters = [ctx.Process(target=_starter, args=(str(tmp_path), barrier, results, NUM_ROUNDS), daemon=True)
                for _ in range(NUM_STARTERS)]
    for p in starters:
        p.start()
    bad: list[tuple[int, list[str]]] = []
    try:
        for i in range(NUM_ROUNDS):
            _write_stale_lock(tmp_path / f"round{i}", dead_claim=i % 2 == 1)
            barrier.wait(WAIT_S)
            outcomes = [results.get(timeout=WAIT_S)[2] for _ in range(NUM_STARTERS)]
            barrier.wait(WAIT_S)
            barrier.wait(WAIT_S)
            if outcomes.count("held") != 1 or any(o not in ("held", "refused") for o in outcomes):
                bad.append((i, outcomes))
            assert not (tmp_path / f"round{i}" / "run.lock").exists(), "the holder's release left its lock"
    finally:
        for p in starters:
            p.join(timeout=WAIT_S)
            if p.is_alive():
                p.kill()  # our own child, by its handle
    assert not bad, (f"{len(bad)} of {NUM_ROUNDS} rounds did not end with exactly one holder; first ones: "
                     f"{bad[:3]}")
    leftovers = sorted({p.name for p in tmp_path.glob("round*/*")})
    assert not leftovers, f"files left beside the locks: {leftovers}"


def test_a_claim_left_by_a_dead_starter_is_taken_over_and_a_live_one_is_respected(tmp_path):
    """Unit: a starter that died between claiming a stale lock and renaming its claim onto it does not
    block the directory forever; a starter taking over right now is named in the refusal."""
    from megatron_bapo.run_lock import LockError, RunLock, _process_start

    _write_stale_lock(tmp_path / "dead", dead_claim=True)
    lock = RunLock.acquire(tmp_path / "dead")
    assert lock.took_over and f"pid {os.getpid()} no longer runs on this host" in lock.took_over
    assert sorted(p.name for p in (tmp_path / "dead").iterdir()) == ["run.lock"]
    lock.release()
    assert not list((tmp_path / "dead").iterdir())

    out = tmp_path / "live"
    _write_stale_lock(out)
    live = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
            "started": "just now", "token": "taking-over"}
    claim = out / f"run.lock.next-{hashlib.sha1(_gone('gone')).hexdigest()}"
    claim.write_text(json.dumps(live))
    with pytest.raises(LockError, match=f"in use by another run .host {socket.gethostname()}, pid {os.getpid()}, "
                                        f"started just now"):
        RunLock.acquire(out)
    assert json.loads(claim.read_text())["token"] == "taking-over" and (out / "run.lock").read_bytes() == _gone("gone")
