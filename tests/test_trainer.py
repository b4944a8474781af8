"""The RL loop end to end as a user runs it: `python -m megatron_bapo.train` in a subprocess, with the
built-in rollout server (real loopback HTTP), the megatron-core actor on CPU, disk weight sync,
TensorBoard events read back, and a real SIGKILL in the middle of a step followed by `--resume`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_bapo.metrics import read_jsonl_metrics, read_tensorboard_scalars

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

# A reward with signal for a random model: half the responses score. Loaded by import path, as
# users plug in their own rewards.
REWARD_MODULE = '''
def parity_reward(response: str, answer: str) -> float:
    return float(len(response) % 2 == 0)
'''

# design section 4 metrics (and rollout/timing ones) the trainer must log every step.
EXPECTED_TAGS = [
    "bapo/c_low", "bapo/c_high", "bapo/rho_before", "bapo/rho_after", "bapo/search_steps",
    "actor/clipfrac_pos", "actor/clipfrac_neg", "actor/entropy", "actor/kl", "actor/grad_norm",
    "actor/pos_token_frac", "rollout/reward_mean", "rollout/accuracy", "rollout/response_len_mean",
    "rollout/buffer_groups", "staleness/mean", "timing/rollout_s", "timing/train_s", "timing/sync_s",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    root = tmp_path_factory.mktemp("trainer_assets")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]} for a in range(10, 40) for b in range(10, 14)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    (root / "parity_reward_mod.py").write_text(REWARD_MODULE)
    return root, tiny_hf_dir


def _config(assets, out: Path, **trainer) -> Path:
    root, model = assets
    cfg = {
        "bapo_preset": "bapo",
        "model": {"hf_path": str(model)},
        "data": {"path": str(root / "train.jsonl"), "apply_chat_template": False, "max_prompt_tokens": 32},
        "trainer": {"output_dir": str(out), "total_steps": 3, "save_every": 2, "progress": False, **trainer},
        "rollout": {"group_size": 4, "prompts_per_step": 3, "max_response_tokens": 6, "segment_tokens": 3,
                    "max_staleness": 2, "client": {"health_timeout_s": 180}},
        "reward": {"fn": "parity_reward_mod:parity_reward", "num_workers": 0},
        "actor": {"optim": {"lr": 1e-3}, "n_minibatches": 2, "max_tokens_per_microbatch": 256,
                  "vocab_divisible_by": 64},
        "eval": {"every_n_steps": 3, "datasets": [{"name": "t", "path": str(root / "test.jsonl")}], "n": 2,
                 "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "reward": "parity_reward_mod:parity_reward"},
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(assets) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(assets[0]), str(ROOT), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _train(config: Path, assets, *extra: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_bapo.train", "--config", str(config), *extra]
    return subprocess.Popen(cmd, env=_env(assets), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _pids_running(config: Path) -> list[int]:
    """Live processes started with this config: the trainer and anything it forked (same command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(config) in cmdline and _pid_alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


def _server_pids(out: Path) -> list[int]:
    path = out / "servers.json"
    return [s["pid"] for s in json.loads(path.read_text())] if path.exists() else []


def test_train_end_to_end_tensorboard_and_cleanup(assets, tmp_path):
    out = tmp_path / "run"
    proc = _train(_config(assets, out), assets)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
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
    pids = _server_pids(out)
    assert pids and not any(_pid_alive(p) for p in pids)


@pytest.mark.parametrize("async_steps", [0, 1])
def test_sigkill_mid_step_then_resume_loses_and_duplicates_nothing(assets, tmp_path, async_steps):
    """SIGKILL mid-step, resume: the ledger shows no prompt lost or trained twice. With rollout one
    step ahead (async_steps=1) the checkpoint also holds the round produced ahead, and the servers
    have requests in flight when the trainer dies."""
    out = tmp_path / "run"
    config = _config(assets, out, total_steps=4, save_every=1, async_steps=async_steps)
    proc = _train(config, assets)
    ledger = out / "samples.jsonl"
    deadline = time.monotonic() + 600
    try:
        # Kill after step 2's checkpoint, once step 3's rollout is recorded (mid-step: before its update).
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"trainer exited early: {proc.stdout.read()[-4000:]}")
            steps = [json.loads(ln)["step"] for ln in ledger.read_text().splitlines()] if ledger.exists() else []
            latest = out / "checkpoints" / "latest"
            if 3 in steps and latest.exists() and latest.read_text().strip() == "step_000002":
                break
            time.sleep(0.05)
        else:
            pytest.fail("timed out waiting for step 3")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_servers = _server_pids(out)
    # Orphaned built-in servers notice their parent is gone and exit on their own.
    t0 = time.monotonic()
    while any(_pid_alive(p) for p in killed_servers) and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    assert not any(_pid_alive(p) for p in killed_servers), "built-in servers outlived the killed trainer"
    assert _pids_running(config) == [], "a process forked by the trainer outlived it"

    resumed = _train(config, assets, "--resume")
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log[-4000:]
    assert "resuming from" in log and "step_000002" in log

    lines = [json.loads(ln) for ln in ledger.read_text().splitlines()]
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


def test_async_rollout_runs_ahead_within_the_staleness_cap(assets, tmp_path):
    """trainer.async_steps=1: rounds are produced one step ahead (the trainer finds them ready), no
    trained token is more than rollout.max_staleness versions old, and some are older than the
    update that trains them (off-policy, as intended)."""
    out = tmp_path / "run"
    config = _config(assets, out, total_steps=5, save_every=0, async_steps=1)
    proc = _train(config, assets)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    records = [r for r in read_jsonl_metrics(out / "tb") if "timing/step_s" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    trained = [r for r in records if "staleness/version_lag_max" in r]
    assert len(trained) >= 3
    cap = yaml.safe_load(config.read_text())["rollout"]["max_staleness"]
    assert all(r["staleness/version_lag_max"] <= cap for r in trained)
    assert max(r["staleness/version_lag_max"] for r in trained) >= 1
    assert all("timing/rollout_wait_s" in r for r in records)
