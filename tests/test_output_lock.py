"""One run per `trainer.output_dir` (`megatron_bapo.run_lock`): the same job started twice (a double
`sbatch`) is refused in one line naming the run that holds the directory, before it writes anything
there; a lock left by a run that died is taken over with one line. Through the CLI, as a user runs it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from run_helpers import finish, last_line, run_config, start_train, write_assets

pytestmark = pytest.mark.slow
LOCK_NAME = "run.lock"  # megatron_bapo.run_lock.LOCK_NAME (spelt out: the CLI tests need no import of it)


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("lock_assets")), tiny_hf_dir


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _take_over_a_dead_runs_lock(assets, out):
    out.mkdir()
    dead = _dead_pid()
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "started": "earlier",
                                             "token": "crashed-run"}))
    config = run_config(assets, out, total_steps=1, save_every=0, eval_at_start=False)
    proc = start_train(config, assets, "eval.every_n_steps=0")
    log = finish(proc)
    return proc.returncode, log, dead, out


@pytest.fixture(scope="module")
def takeover(assets, tmp_path_factory):
    """`test_a_dead_runs_lock_is_taken_over_with_one_line`'s run, started beside the first test's runs
    (a run uses about one core): a future of (exit status, console output, the dead pid in the lock,
    the output directory)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="takeover")
    future = pool.submit(_take_over_a_dead_runs_lock, assets, tmp_path_factory.mktemp("takeover") / "run")
    yield future
    pool.shutdown(wait=True)


@pytest.mark.usefixtures("takeover")  # starts that run now, beside this test's
def test_second_start_on_one_output_dir_is_refused_naming_the_holder(assets, tmp_path):
    out = tmp_path / "run"
    config = run_config(assets, out, total_steps=4, save_every=2, eval_at_start=False)
    first = start_train(config, assets, "eval.every_n_steps=0")
    try:
        train_log = out / "logs" / "train.log"
        deadline = time.monotonic() + 300
        while not (train_log.exists() and "start: pid" in train_log.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        started = time.monotonic()
        second = start_train(config, assets, "eval.every_n_steps=0")
        log = finish(second, timeout=120)
        refused_after = time.monotonic() - started
        assert first.poll() is None, "the first run ended before the second was refused: the test proves nothing"
        first_log = finish(first)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, log[-3000:]
    lines = [ln for ln in log.splitlines() if ln.strip()]
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith(f"lock error: trainer.output_dir={str(out)!r} is in use by another run (host "
                               f"{socket.gethostname()}, pid {first.pid}, started "), lines[0]
    assert "Traceback" not in log and refused_after < 60
    assert first.returncode == 0, first_log[-3000:]
    # The second start wrote nothing: one run's log, one run's ledger, each step once.
    assert train_log.read_text().count("start: pid") == 1
    steps = [json.loads(ln)["step"] for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert not (out / LOCK_NAME).exists(), "the lock outlived its run"


def test_a_dead_runs_lock_is_taken_over_with_one_line(takeover):
    code, log, dead, out = takeover.result()  # _take_over_a_dead_runs_lock
    assert code == 0, log[-3000:]
    took = [ln for ln in log.splitlines() if "took over the lock" in ln]
    assert len(took) == 1 and f"pid {dead} no longer runs on this host" in took[0], log[-3000:]
    assert not (out / LOCK_NAME).exists()


def test_lock_of_a_live_process_is_kept_and_a_reused_pid_is_not_mistaken_for_it(tmp_path):
    """Unit: a holder that runs keeps its lock (this process, as another starter sees it); a lock
    whose pid now names another process (the recorded start time differs) is stale."""
    from megatron_bapo.run_lock import LockError, RunLock

    held = RunLock.acquire(tmp_path)
    try:
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            RunLock.acquire(tmp_path)
    finally:
        held.release()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                  "process_start": "1", "started": "long ago", "token": "old"}))
    lock = RunLock.acquire(tmp_path)
    assert lock.took_over and f"pid {os.getpid()} no longer runs" in lock.took_over
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
