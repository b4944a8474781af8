"""The RL loop end to end as a user runs it: `python -m megatron_bapo.train` in a subprocess, with the
built-in rollout server (real loopback HTTP), the megatron-core actor on CPU, disk weight sync,
TensorBoard events read back, and a real SIGKILL in the middle of a step followed by `--resume`.
"""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from megatron_bapo.metrics import read_jsonl_metrics, read_tensorboard_scalars
from run_helpers import finish, pid_alive, pids_running, run_config, server_pids, start_train, write_assets

pytestmark = pytest.mark.slow
# design section 4 metrics (and rollout/timing ones) the trainer must log every step.
EXPECTED_TAGS = [
    "bapo/c_low", "bapo/c_high", "bapo/rho_before", "bapo/rho_after", "bapo/search_steps",
    "actor/clipfrac_pos", "actor/clipfrac_neg", "actor/entropy", "actor/kl", "actor/grad_norm",
    "actor/pos_token_frac", "rollout/reward_mean", "rollout/accuracy", "rollout/response_len_mean",
    "rollout/buffer_groups", "staleness/mean", "timing/rollout_s", "timing/train_s", "timing/sync_s",
    # What the rollout driver costs rank 0's step: its own time, and its thread's CPU next to training.
    "timing/driver_s", "timing/driver_thread_cpu_s",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("trainer_assets")), tiny_hf_dir


def _run(config, assets) -> tuple[int, str]:
    proc = start_train(config, assets)
    log = finish(proc)
    return proc.returncode, log


def _kill_mid_step_then_resume(config, assets, out) -> str:
    """SIGKILL the run mid-step 4, once its rollout is recorded (before its update), while step 2's
    checkpoint is the newest complete one and step 3's is saved but not completed (that happens at the
    end of step 4: `checkpoint_save`); check that nothing it started outlives it; resume it (from step
    2). Returns the resumed run's log."""
    proc = start_train(config, assets)
    ledger = out / "samples.jsonl"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"trainer exited early: {proc.stdout.read()[-4000:]}")
            steps = [json.loads(ln)["step"] for ln in ledger.read_text().splitlines()] if ledger.exists() else []
            latest = out / "checkpoints" / "latest"
            if 4 in steps and latest.exists() and latest.read_text().strip() == "step_000002":
                break
            time.sleep(0.05)
        else:
            pytest.fail("timed out waiting for step 4")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_servers = server_pids(out)
    # Orphaned built-in servers notice their parent is gone and exit on their own.
    t0 = time.monotonic()
    while any(pid_alive(p) for p in killed_servers) and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in killed_servers), "built-in servers outlived the killed trainer"
    assert pids_running(config) == [], "a process forked by the trainer outlived it"

    resumed = start_train(config, assets, "--resume")
    log = finish(resumed)
    assert resumed.returncode == 0, log[-4000:]
    return log


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """The module's CLI runs, started together and run two at a time (a run spends most of its time on
    one core: its imports, its server's start): {name: (config, output_dir, future)}. The futures give
    (exit status, console output) for "end_to_end" and "async", the resumed run's console output for
    "sigkill_0" and "sigkill_1" (the kill and its checks run in the pool too). Each test checks its own."""
    root = tmp_path_factory.mktemp("trainer_runs")
    configs = {
        "end_to_end": run_config(assets, root / "end_to_end"),
        "sigkill_0": run_config(assets, root / "sigkill_0", total_steps=4, save_every=1, async_steps=0),
        "sigkill_1": run_config(assets, root / "sigkill_1", total_steps=4, save_every=1, async_steps=1),
        "async": run_config(assets, root / "async", total_steps=5, save_every=0, async_steps=1,
                            max_steps_without_update=2),
    }
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainer-run")
    futures = {name: pool.submit(_kill_mid_step_then_resume, config, assets, root / name) if name.startswith("sigkill")
               else pool.submit(_run, config, assets) for name, config in configs.items()}
    yield {name: (configs[name], root / name, futures[name]) for name in configs}
    pool.shutdown(wait=True, cancel_futures=True)


def test_train_end_to_end_tensorboard_and_cleanup(runs):
    _, out, future = runs["end_to_end"]
    code, log = future.result()
    assert code == 0, log[-4000:]
    # The console: compact lines (the last step's, with console_every=10), eval results, no INFO
    # records; those are in logs/train.log.
    assert re.search(r"^step 3/3  reward [\d.]+  acc [\d.]+  c_low [\d.]+ c_high [\d.]+  rho [\d.]+->[\d.]+  "
                     r"entropy [\d.]+  [\d.]+ s/step$", log, re.M), log[-4000:]
    assert re.search(r"^eval step 0  t avg@2 [\d.]+$", log, re.M) and re.search(r"^eval step 3  t avg@2 [\d.]+$", log, re.M)
    assert " INFO " not in log, log[-4000:]
    assert "WARNING" not in log and "Warning:" not in log, log[-4000:]  # a healthy run: nothing to alarm
    full = (out / "logs" / "train.log").read_text()
    assert "actor built" in full and "step 2: reward=" in full and "step 3/3  reward" in full
    scalars = read_tensorboard_scalars(out / "tb")
    missing = [t for t in EXPECTED_TAGS if t not in scalars]
    assert not missing, f"missing TensorBoard tags {missing}; have {sorted(scalars)}"
    # Partial rollout: a random model rarely stops, so a response needs 2 segments (3 + 3 tokens);
    # step 1 finishes no group (no update, no new version), steps 2 and 3 train.
    trained = [s for s, n in scalars["experience/num_samples"] if n > 0]
    assert trained == [2, 3]
    assert [s for s, _ in scalars["bapo/c_high"]] == trained
    for _, c_high in scalars["bapo/c_high"]:
        assert 1.2 - 1e-6 <= c_high <= 3.0 + 1e-6
    assert "eval/t/avg@2" in scalars and [s for s, _ in scalars["eval/t/avg@2"]] == [0, 3]
    # Weight sync after every update: the servers serve the newest version.
    assert scalars["train/version"] == [(1, 0.0), (2, 1.0), (3, 2.0)]
    assert (out / "hf_sync" / "v000002" / "config.json").exists()
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000002", "step_000003"]
    state = json.loads((out / "checkpoints" / "step_000003" / "trainer.json").read_text())
    assert state["step"] == 3 and state["version"] == 2
    # Built-in servers were stopped by PID.
    pids = server_pids(out)
    assert pids and not any(pid_alive(p) for p in pids)


@pytest.mark.parametrize("async_steps", [0, 1])
def test_sigkill_mid_step_then_resume_loses_and_duplicates_nothing(runs, async_steps):
    """SIGKILL mid-step, resume: the ledger shows no prompt lost or trained twice. With rollout one
    step ahead (async_steps=1) the checkpoint also holds the round produced ahead, and the servers
    have requests in flight when the trainer dies."""
    _, out, future = runs[f"sigkill_{async_steps}"]
    log = future.result()  # killed mid-step, nothing of it left running, resumed (_kill_mid_step_then_resume)
    assert "resuming from" in log and "step_000002" in log

    lines = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4]
    drawn = [i for ln in lines for i in ln["drawn"]]
    trained_groups = [g for ln in lines for g, _ in ln["trained"]]
    assert len(set(drawn)) == len(drawn), "a prompt was drawn twice within one epoch"
    assert len(set(trained_groups)) == len(trained_groups), "a group was trained twice"
    final = json.loads((out / "checkpoints" / "step_000004" / "trainer.json").read_text())
    buffered = [g["prompt"]["index"] for g in final["rollout"]["groups"]]
    trained = [i for ln in lines for _, i in ln["trained"]]
    ahead = final["rounds"]["ready"]  # rounds produced ahead of training, not yet recorded
    assert len(ahead) == async_steps
    drawn_ahead = [p["index"] for r in ahead for p in r["prompts"]]
    finished_ahead = [g["prompt"]["index"] for r in ahead for g in r["groups"]]
    # Every drawn prompt is trained, still in the partial-rollout buffer, or in a round produced
    # ahead: nothing lost, nothing twice.
    assert sorted(trained + buffered + finished_ahead) == sorted(drawn + drawn_ahead)
    assert final["data"]["position"] == len(drawn) + len(drawn_ahead)
    records = read_jsonl_metrics(out / "tb")
    assert [r["step"] for r in records if "timing/step_s" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "bapo/c_high" in r] == [2, 3, 4]  # step 1 finished no group


def test_async_rollout_runs_ahead_within_the_staleness_cap(runs):
    """trainer.async_steps=1: rounds are produced one step ahead (the trainer finds them ready), no
    trained token is more than rollout.max_staleness versions old, and some are older than the
    update that trains them (off-policy, as intended). The progress watchdog at the tightest limit
    the config accepts (2: a response takes 2 steps) does not stop this healthy partial + async run;
    its derived default (2 x (2 + 1) + 2 = 8) is four times that."""
    config, out, future = runs["async"]
    code, log = future.result()
    assert code == 0, log[-4000:]
    records = [r for r in read_jsonl_metrics(out / "tb") if "timing/step_s" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    trained = [r for r in records if "staleness/version_lag_max" in r]
    assert len(trained) >= 3
    cap = yaml.safe_load(config.read_text())["rollout"]["max_staleness"]
    assert all(r["staleness/version_lag_max"] <= cap for r in trained)
    assert max(r["staleness/version_lag_max"] for r in trained) >= 1
    assert all("timing/rollout_wait_s" in r for r in records)
    assert [r["train/updated"] for r in records] == [0.0, 1.0, 1.0, 1.0, 1.0]
