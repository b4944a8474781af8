"""The 32B/64k recipe's knobs through the CLI, as a user launches them (`torchrun -m megatron_bapo.train`).

1. The first update is on-policy: the trainer recomputes exactly the distribution the built-in
   server sampled from, at temperature 0.6 (softmax(logits / T)), so KL(behavior || current) is ~0
   and the importance ratio ~1, for one process and for TP 2 + SP, PP 2 and CP 2. (Before the temperature
   reached the trainer this KL was ~1e-2 on the same model.) TP 2 without SP is the Qwen3 TP 2 run below
   (and the bf16 run's mismatch), TP 2 x CP 2 the 8-rank rehearsal's first update (TP 2 + SP x PP 2 x
   CP 2 at temperature 0.6), so they get no run of their own (16 s and 26 s on 2 cores). A tiny Qwen3
   (per-head q/k norms, head_dim 32 on a 64 hidden size, untied head) runs 3 BAPO steps on one process
   (disk weight sync) and under TP 2 (distributed gloo sync): every step's update is on-policy after the
   weight sync, KL below 1e-6. With a bf16 built-in server and `old_logprobs: recompute` (TIS) under
   TP 2 the mismatch is logged and each update still starts on-policy (ratio 1, KL < 1e-8).
2. The rehearsal: a tiny model with the 32B config's knobs all at once (TP 2 with SP, PP 2, CP 2:
   8 ranks; full recompute, distributed optimizer, temperature 0.6, packing, partial rollout,
   distributed gloo weight sync) runs a few RL steps, and every step's loss, log-prob statistics
   and gradient norm equal the single-process run of the same config (seeded requests make the
   rollouts identical).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


# A reward with signal for a random model (about half the responses score), loaded by import path.
REWARD_MODULE = """
def parity_reward(response: str, answer: str) -> float:
    return float(len(response) % 2 == 0)
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    root = tmp_path_factory.mktemp("recipe")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]} for a in range(10, 60) for b in range(10, 14)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "recipe_reward.py").write_text(REWARD_MODULE)
    return root, tiny_hf_dir


@pytest.fixture(scope="module")
def qwen3_assets(assets, tmp_path_factory):
    """The same task with a tiny random Qwen3 policy (megatron_bapo.tiny's Qwen3 defaults, untied head)."""
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    root, _ = assets
    return root, make_tiny_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), seed=0, architecture="qwen3",
                                         tie_word_embeddings=False)


def _config(assets, out: Path, **sections) -> Path:
    root, model = assets
    cfg = {
        "bapo_preset": "bapo",
        "model": {"hf_path": str(model)},
        "data": {"path": str(root / "train.jsonl"), "apply_chat_template": False, "max_prompt_tokens": 32},
        "trainer": {"output_dir": str(out), "total_steps": 1, "save_every": 0, "progress": False, "seed": 3},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_response_tokens": 8, "sampling": {"temperature": 0.6},
                    "client": {"health_timeout_s": 180}},
        "reward": {"fn": "recipe_reward:parity_reward", "num_workers": 0},
        "actor": {"optim": {"lr": 1e-3}, "n_minibatches": 1, "max_tokens_per_microbatch": 256,
                  "vocab_divisible_by": 64},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(config: Path, nproc: int, *overrides: str, timeout: float = 900, resume: bool = False) -> list[dict]:
    """Train through the CLI (torchrun for several ranks); the per-step metrics it logged."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    data_dir = Path(yaml.safe_load(config.read_text())["data"]["path"]).parent  # the reward module
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(data_dir), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_bapo.train"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_bapo.train"]
    proc = subprocess.run(cmd + ["--config", str(config), "--resume" if resume else "--no-resume", *overrides], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        (config.parent / f"{config.stem}.log").write_text(proc.stdout + proc.stderr)
        first = proc.stderr.find("Traceback")  # the first rank to fail prints first; the others follow it down
        pytest.fail(f"exit {proc.returncode}; full log {config.parent / config.stem}.log\n"
                    + proc.stdout[-2000:] + (proc.stderr[first:first + 5000] if first >= 0 else "")
                    + "\n...\n" + proc.stderr[-3000:])
    out = Path(yaml.safe_load(config.read_text())["trainer"]["output_dir"])
    return [json.loads(line) for line in (out / "tb" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _first_update(metrics: list[dict]) -> dict:
    return next(m for m in metrics if "actor/kl_k1" in m)


LAYOUTS = {
    "one-process": (1, []),
    "tp2-sp": (2, ["actor.parallel.tp=2", "actor.parallel.sequence_parallel=true"]),
    "pp2": (2, ["actor.parallel.pp=2"]),
    "cp2": (2, ["actor.parallel.cp=2"]),
    "qwen3-one-process": (1, ["trainer.total_steps=3"]),
    "qwen3-tp2": (2, ["trainer.total_steps=3", "actor.parallel.tp=2", "sync.method=distributed", "sync.backend=gloo"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_first_update_sees_the_servers_logprobs_at_temperature(request, tmp_path, name):
    nproc, overrides = LAYOUTS[name]
    qwen3 = name.startswith("qwen3")
    assets = request.getfixturevalue("qwen3_assets" if qwen3 else "assets")
    metrics = _run(_config(assets, tmp_path / name), nproc, *overrides)
    first = _first_update(metrics)
    assert first["actor/num_loss_tokens"] > 50
    assert abs(first["actor/kl_k1"]) < 1e-4, first["actor/kl_k1"]
    assert abs(first["actor/ratio_mean"] - 1.0) < 1e-3, first["actor/ratio_mean"]
    if qwen3:  # every step: one update per step, on the weights the servers sampled with (synced from disk)
        updates = [m for m in metrics if "actor/kl_k1" in m]
        assert [m["step"] for m in updates] == [1, 2, 3], [m["step"] for m in updates]
        assert all(abs(m["actor/kl_k1"]) < 1e-6 and abs(m["actor/ratio_mean"] - 1.0) < 1e-6 for m in updates), updates
        assert all(m["actor/grad_norm"] > 0 and m["actor/loss"] != 0 for m in updates), updates


def test_recompute_with_a_bf16_server_through_the_cli_under_tp2(assets, tmp_path):
    """The trainer's path (scatter over the gloo group, metrics.jsonl): a bf16 built-in server
    (`rollout.builtin_server_dtype`), `old_logprobs: recompute` with TIS under TP 2. The mismatch is
    measured and logged, and every update starts on-policy against the recomputed log-probs."""
    metrics = _run(_config(assets, tmp_path / "recompute"), 2, "actor.parallel.tp=2", "trainer.total_steps=2",
                   "rollout.builtin_server_dtype=bfloat16", "actor.old_logprobs=recompute",
                   "actor.correction.mode=tis")
    updates = [m for m in metrics if "actor/kl" in m]
    assert [m["step"] for m in updates] == [1, 2]
    for m in updates:
        assert abs(m["actor/ratio_mean"] - 1.0) < 1e-6 and abs(m["actor/kl"]) < 1e-8, m
        assert m["mismatch/num_tokens"] > 50 and 0 < m["mismatch/kl_k3"] < 1e-3, m  # bf16: small, not zero
        assert 0 < m["correction/weight_mean"] <= 2.0


RECIPE = dict(
    trainer={"total_steps": 3},
    # Seeded sampling (sent only to servers with deterministic inference) makes both runs' rollouts identical.
    rollout={"max_response_tokens": 8, "segment_tokens": 4, "max_staleness": 2, "prompts_per_step": 4,
             "deterministic_inference": True},
    actor={"recompute": "full", "use_distributed_optimizer": True, "packing": True, "dtype": "float32",
           "max_tokens_per_microbatch": 96},
)


@pytest.fixture(scope="module")
def rehearsal(assets, tmp_path_factory):
    """The recipe's knobs on one process and on 8 ranks (the 8 checkpoint at step 2): (root, one, eight)."""
    root = tmp_path_factory.mktemp("rehearsal")
    sync = {"method": "distributed", "backend": "gloo"}
    # sync.master_port 0 (the default): rank 0 binds a free port itself. A port picked here could be taken by
    # the eight ranks' own gloo connections before the group binds it (EADDRINUSE, seen in CI).
    one = _run(_config(assets, root / "single", **RECIPE, sync=sync), 1)
    eight = _run(_config(assets, root / "eight", **RECIPE, sync=sync), 8, *EIGHT, "trainer.save_every=2")
    return root, one, eight


# The recipes run the driver in its own process (trainer.driver_process): every rank's slice is cut there.
EIGHT = ("actor.parallel.tp=2", "actor.parallel.sequence_parallel=true", "actor.parallel.pp=2", "actor.parallel.cp=2",
         "trainer.driver_process=true")


def test_recipe_rehearsal_8_ranks_equals_one_process(rehearsal):
    _, one, eight = rehearsal
    updates = [m for m in one if "actor/loss" in m]
    assert len(updates) >= 2 and any(m["staleness/max"] > 0 for m in updates)  # partial rollout spanned updates
    assert all(m["actor/loss"] != 0 and m["actor/grad_norm"] > 0 for m in updates)  # real updates compared
    first = _first_update(eight)
    assert abs(first["actor/kl_k1"]) < 1e-4 and abs(first["actor/ratio_mean"] - 1.0) < 1e-3
    assert [m["step"] for m in eight] == [m["step"] for m in one]
    for a, b in zip(one, eight):
        assert a["rollout/num_tokens_generated"] == b["rollout/num_tokens_generated"]  # identical rollouts
        for key in ("actor/loss", "actor/kl_k1", "actor/entropy", "actor/ratio_mean", "actor/grad_norm",
                    "actor/num_loss_tokens", "bapo/c_low", "bapo/c_high", "staleness/mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["step"], key)


def test_recipe_rehearsal_resumed_equals_uninterrupted(rehearsal, assets):
    """Resumed from the 8 ranks' step-2 checkpoint (hashed by every rank, the buffer in binary, verified in
    parallel), step 3 equals the uninterrupted run's: model, optimizer, RNG, buffer and data position.
    (It did not while megatron-core's `fully_reshardable` save shifted the tied embedding's optimizer state
    by one row, actor/distopt_state.py 6: each CP rank overwrote its half of the loaded embedding with it,
    so the servers, synced from CP rank 0, sampled from other weights than the trainer's, KL 0.069 at lag 0.)"""
    root, _, eight = rehearsal
    sync = {"method": "distributed", "backend": "gloo"}
    resumed_dir = root / "eight_resumed"
    shutil.copytree(root / "eight", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_000003")
    resumed = _run(_config(assets, resumed_dir, **RECIPE, sync=sync), 8, *EIGHT, resume=True)
    [a] = [m for m in eight if m["step"] == 3]
    [b] = [m for m in resumed if m["step"] == 3]
    assert a["rollout/num_tokens_generated"] == b["rollout/num_tokens_generated"]
    for key in ("mismatch/kl_k3", "actor/loss", "actor/kl_k1", "actor/entropy", "actor/ratio_mean", "actor/grad_norm",
                "actor/lr", "actor/num_loss_tokens", "bapo/c_low", "bapo/c_high", "staleness/mean", "train/version"):
        assert (key in a) == (key in b), key
        if key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), key


@pytest.mark.gpu
@pytest.mark.parametrize("packing", ["true", "false"])
def test_first_update_on_policy_on_one_gpu(assets, tmp_path, packing):
    """The CUDA path (Transformer Engine attention when installed, THD kernels when packed)."""
    first = _first_update(_run(_config(assets, tmp_path / f"gpu-{packing}"), 1, f"actor.packing={packing}"))
    assert abs(first["actor/kl_k1"]) < 1e-4 and abs(first["actor/ratio_mean"] - 1.0) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("packing", ["true", "false"])
def test_context_parallel_on_two_gpus(assets, tmp_path, packing):
    """CP=2 through TE's context-parallel attention (the CPU all-gather attention's GPU counterpart)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"CP=2 on GPUs needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    first = _first_update(_run(_config(assets, tmp_path / f"gpu-cp2-{packing}"), 2, "actor.parallel.cp=2",
                               f"actor.packing={packing}"))
    assert abs(first["actor/kl_k1"]) < 1e-4 and abs(first["actor/ratio_mean"] - 1.0) < 1e-3
