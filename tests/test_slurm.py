"""The tiny BAPO run submitted to a real one-node SLURM cluster (slurmctld + slurmd + munge).

`sbatch --wait examples/run_tiny_slurm.sh`: the built-in rollout server and the actor run as SLURM
job steps; the test checks that training steps ran, TensorBoard events were written and that no
process of the job outlives it. The cluster comes from tests/slurm/start_cluster.sh (skipped with
its reason when SLURM cannot be installed here).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    if not (ROOT / "megatron_bapo/train.py").exists():
        pytest.skip("megatron_bapo/train.py (the trainer) is not in this checkout yet")
    state = tmp_path_factory.mktemp("slurm_state")
    out = subprocess.run(["bash", str(ROOT / "tests/slurm/start_cluster.sh"), str(state)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode == 77:
        pytest.skip(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(state / "slurm.conf")
    yield env
    subprocess.run(["bash", str(ROOT / "tests/slurm/stop_cluster.sh"), str(state)], timeout=120)


def _tiny_assets(root: Path) -> Path:
    """Model (random tiny Qwen2 + char tokenizer) and task data, without the SFT warm start."""
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint
    from megatron_bapo.tiny.task import generate_splits, write_jsonl

    make_tiny_hf_checkpoint(root / "base_model", seed=0)
    train, test = generate_splits()
    write_jsonl(train, root / "data/train.jsonl")
    write_jsonl(test[:16], root / "data/test.jsonl")
    (root / "info.json").write_text("{}\n")
    return root


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{proc.name}: {cmd}")
    return found


def test_tiny_run_as_slurm_job_steps(slurm_env, tmp_path):
    from megatron_bapo.metrics import read_jsonl_metrics, read_tensorboard_scalars

    assets = _tiny_assets(tmp_path / "assets")
    out_dir = tmp_path / "run"
    env = dict(slurm_env, TINY_DIR=str(assets), OUTPUT_DIR=str(out_dir), PYTHON=str(ROOT / ".venv/bin/python"),
               CLEANUP_TIMEOUT="20", SYNC_METHOD="distributed", SYNC_PORT="0")
    job_out = tmp_path / "job.out"
    res = subprocess.run(
        ["sbatch", "--wait", "-o", str(job_out), "--chdir", str(ROOT), str(ROOT / "examples/run_tiny_slurm.sh"),
         "trainer.total_steps=2", "rollout.prompts_per_step=4", "eval.every_n_steps=0", "trainer.save_every=0"],
        capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT,
    )
    log = job_out.read_text() if job_out.exists() else ""
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out_dir.glob("logs/*/*.log")))
    assert res.returncode == 0, f"{res.stdout}{res.stderr}\n{log}\n{logs}"
    # training steps ran and were logged to TensorBoard
    steps = [row["step"] for row in read_jsonl_metrics(out_dir / "tb")]
    assert steps[:2] == [1, 2], steps
    assert list((out_dir / "tb").glob("events.out.tfevents.*"))
    scalars = read_tensorboard_scalars(out_dir / "tb")
    assert {s for series in scalars.values() for s, _ in series} == {1, 2}
    assert scalars["actor/loss"], "no optimizer step ran"  # step 1 may hold only partial rollouts
    # both steps were job steps of the job, and every process they started is gone
    # the weights reached the server through the distributed (gloo) sync
    assert "sync.method=distributed" in log and "joined weight update group" in logs
    assert "started server" in log and "started actor" in log and "cleanup: done (exit status 0)" in log
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(assets)) and time.monotonic() < deadline:
        time.sleep(1)
    assert _processes_mentioning(str(assets)) == []
    for pid_file in out_dir.glob("logs/*/*.pid"):
        assert not Path(f"/proc/{pid_file.read_text().strip()}").exists(), pid_file
    queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=slurm_env, timeout=30)
    assert queue.stdout.strip() == ""


def test_scancel_mid_run_leaves_no_process(slurm_env, tmp_path):
    """Cancelling the job while it trains: the trap stops the steps by PID and nothing outlives the job."""
    assets = _tiny_assets(tmp_path / "assets")
    out_dir = tmp_path / "run"
    env = dict(slurm_env, TINY_DIR=str(assets), OUTPUT_DIR=str(out_dir), PYTHON=str(ROOT / ".venv/bin/python"),
               CLEANUP_TIMEOUT="20")
    job_out = tmp_path / "job.out"
    sub = subprocess.run(
        ["sbatch", "--parsable", "-o", str(job_out), "--chdir", str(ROOT), str(ROOT / "examples/run_tiny_slurm.sh"),
         "trainer.total_steps=200", "eval.every_n_steps=0"],
        capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while not list(out_dir.glob("tb/events.out.tfevents.*")):  # the actor is up and training
        assert time.monotonic() < deadline, job_out.read_text() if job_out.exists() else "no job output"
        time.sleep(1)
    assert _processes_mentioning(str(assets))  # server and actor are running
    subprocess.run(["scancel", job_id], env=slurm_env, check=True, timeout=60)
    deadline = time.monotonic() + 120
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=slurm_env,
                         timeout=30).stdout.strip():
        assert time.monotonic() < deadline, "the cancelled job did not leave the queue"
        time.sleep(1)
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(assets)) and time.monotonic() < deadline:
        time.sleep(1)
    assert _processes_mentioning(str(assets)) == []
    assert "cleanup: stopping 2 background step(s)" in job_out.read_text()
