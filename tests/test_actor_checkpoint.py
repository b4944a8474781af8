"""Actor checkpoints: exact resume (model, Adam state, LR schedule, RNG) and TP resharding."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from test_actor_helpers import TINY_QWEN2, full_params, make_batch  # noqa: E402


def _actor(tp=1, dist_opt=True):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(
        optim=OptimConfig(name="adam", lr=1e-3, warmup_steps=3, decay_style="cosine", decay_steps=10,
                          weight_decay=0.01, clip_grad=1.0),
        parallel=ParallelConfig(tp=tp), max_tokens_per_microbatch=60, n_minibatches=2,
        use_distributed_optimizer=dist_opt,
    )
    return Actor(cfg, TINY_QWEN2)


def _batches():
    return [make_batch(num_seqs=8, seed=s) for s in (10, 11, 12)]


def _uninterrupted(rank, world_size):
    actor = _actor()
    metrics = [actor.train_step(b) for b in _batches()]
    return full_params(actor), metrics, torch.rand(3), actor.num_updates


def _first_part(rank, world_size, ckpt):
    actor = _actor()
    actor.train_step(_batches()[0])
    actor.save_checkpoint(ckpt)
    actor.save_checkpoint(ckpt)  # overwriting a complete checkpoint is atomic too
    return sorted(os.listdir(os.path.dirname(ckpt)))


def _resumed(rank, world_size, ckpt):
    actor = _actor()
    meta = actor.load_checkpoint(ckpt)
    metrics = [actor.train_step(b) for b in _batches()[1:]]
    return full_params(actor), metrics, torch.rand(3), actor.num_updates, meta


@pytest.mark.slow
def test_save_load_continue_equals_never_stopping(run_dist, tmp_path):
    """DP=2, Adam with warmup+cosine: a fresh process group resumes bit-for-bit."""
    ckpt = str(tmp_path / "ckpt")
    ref = run_dist(_uninterrupted, 2, timeout=120)
    listing = run_dist(_first_part, 2, ckpt, timeout=120)[0]
    assert listing == ["ckpt"]  # no .tmp/.old left behind
    res = run_dist(_resumed, 2, ckpt, timeout=120)
    for (p_ref, m_ref, rng_ref, n_ref), (p, m, rng, n, meta) in zip(ref, res):
        assert meta["num_updates"] == 2 and n == n_ref == 6
        for name, want in p_ref.items():
            torch.testing.assert_close(p[name], want, atol=0, rtol=0, msg=name)
        assert m[-1]["actor/lr"] == m_ref[-1]["actor/lr"]
        assert m[-1]["actor/grad_norm"] == m_ref[-1]["actor/grad_norm"]
        torch.testing.assert_close(rng, rng_ref, atol=0, rtol=0)  # RNG streams resumed too


def _save_tp2(rank, world_size, ckpt):
    actor = _actor(tp=2)
    actor.train_step(_batches()[0])
    actor.save_checkpoint(ckpt)
    return actor.compute_logprobs(_batches()[1])


def _fresh_logprobs(rank, world_size):
    return _actor().compute_logprobs(_batches()[1])


def _load_tp1(rank, world_size, ckpt):
    actor = _actor(tp=1)
    actor.load_checkpoint(ckpt)
    return actor.compute_logprobs(_batches()[1]), actor.num_updates


def test_save_tp2_load_tp1_same_logprobs(run_dist, tmp_path):
    ckpt = str(tmp_path / "tp2")
    lp_tp2 = run_dist(_save_tp2, 2, ckpt, timeout=120)
    lp_tp1, n = run_dist(_load_tp1, 1, ckpt, timeout=120)[0]
    assert n == 2
    torch.testing.assert_close(lp_tp2[0], lp_tp2[1], atol=0, rtol=0)
    torch.testing.assert_close(lp_tp1, lp_tp2[0], atol=1e-5, rtol=0)
    fresh = run_dist(_fresh_logprobs, 1, timeout=120)[0]
    assert (fresh - lp_tp1).abs().max() > 1e-4  # the load really replaced the weights


def _incomplete(rank, world_size, path):
    actor = _actor()
    try:
        actor.load_checkpoint(path)
    except FileNotFoundError as exc:
        return str(exc)
    return "loaded"


def test_incomplete_checkpoint_is_rejected(run_dist, tmp_path):
    (tmp_path / "half.tmp").mkdir()
    msg = run_dist(_incomplete, 1, str(tmp_path / "half.tmp"), timeout=60)[0]
    assert "not a complete actor checkpoint" in msg
