"""Resume with damaged checkpoints (issue 14): real checkpoints written by `Actor.save_checkpoint`
(tiny Qwen2, one gloo rank) and completed by `run_state.save_trainer_state`, as the trainer does.

Each kind of damage to the newest checkpoint makes `latest_checkpoint` fall back to the previous
one with one WARNING line naming the checkpoint and the bad file; damage to every checkpoint is one
`CheckpointError` naming the directories to remove; a checkpoint from before manifests loads,
unverified, with a warning.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_bapo import run_state  # noqa: E402
from test_actor_helpers import TINY_QWEN2, full_params, make_batch  # noqa: E402


def _actor():
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor

    cfg = ActorConfig(optim=OptimConfig(name="adam", lr=1e-3), max_tokens_per_microbatch=60, n_minibatches=1,
                      use_distributed_optimizer=True)
    return Actor(cfg, TINY_QWEN2)


def _write_two_checkpoints(rank, world_size, out):
    """Steps 2 and 4, each: actor save, then trainer state + manifest (the trainer's order)."""
    actor = _actor()
    params = {}
    for step in (2, 4):
        actor.train_step(make_batch(num_seqs=4, seed=step))
        ckpt = run_state.checkpoint_dir(out, step)
        actor.save_checkpoint(ckpt / "actor")
        run_state.save_trainer_state(ckpt, {"step": step, "version": step})
        params[step] = full_params(actor)
    return params


@pytest.fixture(scope="module")
def written(run_dist_module, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpts")
    params = run_dist_module(_write_two_checkpoints, 1, str(out), timeout=180)[0]
    return out, params


@pytest.fixture(scope="module")
def run_dist_module():
    from dist_harness import run_dist

    return run_dist


@pytest.fixture
def run(written, tmp_path):
    """A fresh copy of the two checkpoints: (output_dir, step-2 dir, step-4 dir)."""
    out = tmp_path / "out"
    shutil.copytree(written[0], out)
    return out, run_state.checkpoint_dir(out, 2), run_state.checkpoint_dir(out, 4)


def _largest_distcp(ckpt: Path) -> Path:
    return max((ckpt / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> str:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.name


def _overwrite_middle(path: Path) -> str:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid: mid + 64] = bytes(b ^ 0xFF for b in data[mid: mid + 64])
    path.write_bytes(bytes(data))
    return path.name


DAMAGE = {
    "truncated_distcp": lambda d: _truncate(_largest_distcp(d)),
    "overwritten_distcp_same_size": lambda d: _overwrite_middle(_largest_distcp(d)),
    "missing_metadata": lambda d: ((d / "actor" / ".metadata").unlink(), ".metadata")[1],
    "missing_common_pt": lambda d: ((d / "actor" / "common.pt").unlink(), "common.pt")[1],
    "truncated_trainer_json": lambda d: _truncate(d / run_state.TRAINER_STATE),
    "missing_rng_state": lambda d: ((d / "actor" / "rng" / "rank0.pt").unlink(), "rank0.pt")[1],
}


def test_manifest_covers_every_file_of_the_step_directory(run):
    out, _, step4 = run
    manifest = json.loads((step4 / run_state.MANIFEST).read_text())
    on_disk = sorted(p.relative_to(step4).as_posix() for p in step4.rglob("*")
                     if p.is_file() and p.name != run_state.MANIFEST)
    assert sorted(manifest["files"]) == on_disk
    assert {"trainer.json", "actor/.metadata", "actor/common.pt", "actor/actor_meta.json", "actor/rng/rank0.pt"} <= set(on_disk)
    assert any(name.endswith(".distcp") for name in on_disk)
    for rel, entry in manifest["files"].items():
        assert run_state.hash_file(step4 / rel) == (entry["size"], entry["sha256"])
    assert (out / "checkpoints" / "latest").read_text() == "step_000004"
    assert run_state.verify_checkpoint(step4) is None and run_state.latest_checkpoint(out) == step4


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(run, damage, caplog):
    out, step2, step4 = run
    bad_file = DAMAGE[damage](step4)
    with caplog.at_level(logging.WARNING, logger="megatron_bapo.run_state"):
        assert run_state.latest_checkpoint(out) == step2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "skipping checkpoint" in warnings[0] and str(step4) in warnings[0] and bad_file in warnings[0], warnings


def test_every_checkpoint_damaged_is_one_error_naming_the_directories(run):
    out, step2, step4 = run
    _truncate(_largest_distcp(step4))
    (step2 / "actor" / ".metadata").unlink()
    with pytest.raises(run_state.CheckpointError) as err:
        run_state.latest_checkpoint(out)
    message = str(err.value)
    assert "\n" not in message and f"rm -r {step4} {step2}" in message
    assert ".distcp has" in message and ".metadata is missing" in message and "--no-resume" in message


def test_interrupted_saves_are_skipped_and_alone_mean_a_fresh_start(run, tmp_path):
    out, step2, step4 = run
    (step4 / run_state.MANIFEST).unlink()  # killed between trainer.json and the manifest
    run_state.checkpoint_dir(out, 6).mkdir()  # killed during the actor save
    assert run_state.latest_checkpoint(out) == step2
    assert run_state.verify_checkpoint(step4).startswith("incomplete")
    only_interrupted = tmp_path / "fresh"
    run_state.checkpoint_dir(only_interrupted, 2).mkdir(parents=True)
    assert run_state.latest_checkpoint(only_interrupted) is None


def _make_old_format(ckpt: Path) -> None:
    """What the previous version wrote: no manifest, no checkpoint_format in trainer.json."""
    (ckpt / run_state.MANIFEST).unlink()
    state = json.loads((ckpt / run_state.TRAINER_STATE).read_text())
    del state[run_state.FORMAT_KEY]
    (ckpt / run_state.TRAINER_STATE).write_text(json.dumps(state))


def _load(rank, world_size, ckpt):
    actor = _actor()
    meta = actor.load_checkpoint(Path(ckpt) / "actor")
    state = run_state.load_trainer_state(Path(ckpt))
    return full_params(actor), meta["num_updates"], state


def test_fallback_and_old_format_checkpoints_load(run, written, run_dist_module, caplog):
    """The fallback chosen after damage loads with the actor; an old checkpoint loads, unverified."""
    out, step2, step4 = run
    _overwrite_middle(_largest_distcp(step4))
    assert run_state.latest_checkpoint(out) == step2
    _make_old_format(step2)
    shutil.rmtree(step4)
    with caplog.at_level(logging.WARNING, logger="megatron_bapo.run_state"):
        assert run_state.latest_checkpoint(out) == step2
    assert any("unverified" in r.getMessage() for r in caplog.records)
    params, num_updates, state = run_dist_module(_load, 1, str(step2), timeout=180)[0]
    assert num_updates == 1 and state == {"step": 2, "version": 2}
    for name, want in written[1][2].items():
        torch.testing.assert_close(params[name], want, atol=0, rtol=0)


def _resume_on_every_rank(rank, world_size, out):
    import torch.distributed as dist

    try:
        return str(run_state.resume_checkpoint(out, group=dist.group.WORLD))
    except run_state.CheckpointError as exc:
        return f"CheckpointError: {exc}"


def test_resume_checkpoint_agrees_on_every_rank(run, run_dist_module):
    out, step2, step4 = run
    _truncate(step4 / run_state.TRAINER_STATE)
    assert run_dist_module(_resume_on_every_rank, 2, str(out), timeout=120) == [str(step2)] * 2
    (step2 / "actor" / "common.pt").unlink()
    errors = run_dist_module(_resume_on_every_rank, 2, str(out), timeout=120)
    assert errors[0] == errors[1] and errors[0].startswith("CheckpointError: no usable checkpoint")


@pytest.mark.slow
def test_train_cli_with_every_checkpoint_damaged_exits_2_with_one_error_line(run, tiny_hf_dir, tmp_path):
    """`python -m megatron_bapo.train --resume` on damaged checkpoints: exit code 2, one
    `checkpoint error:` line naming the directories to remove, no traceback."""
    import subprocess
    import sys

    import yaml

    out, step2, step4 = run
    _truncate(_largest_distcp(step4))
    (step2 / "actor" / "common.pt").unlink()
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(10, 20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward_mod.py").write_text("def reward(response, answer):\n    return 0.0\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"hf_path": str(tiny_hf_dir)},
        "data": {"path": str(tmp_path / "train.jsonl"), "apply_chat_template": False, "max_prompt_tokens": 32},
        "trainer": {"output_dir": str(out), "total_steps": 6, "save_every": 2, "progress": False},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_response_tokens": 4},
        "reward": {"fn": "reward_mod:reward", "num_workers": 0},
        "actor": {"max_tokens_per_microbatch": 256, "vocab_divisible_by": 64},
    }))
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = f"{tmp_path}:{root}"
    proc = subprocess.run([sys.executable, "-m", "megatron_bapo.train", "--config", str(config), "--resume"],
                          env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("checkpoint error:")]
    assert len(errors) == 1 and f"rm -r {step4} {step2}" in errors[0], output[-3000:]
