"""Chunked vocab-parallel log-probs/entropy: values and gradients vs a full log-softmax, TP=2 == TP=1."""

from __future__ import annotations

import pytest
import torch

from megatron_bapo.actor.logprobs import token_aligned_logprobs, vocab_parallel_logprobs


def _reference(logits, targets, vocab_size):
    ls = torch.log_softmax(logits[..., :vocab_size].double(), -1)
    lp = ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    return lp, ent


def _data(seed=0, shape=(3, 11), vocab=64, real=57, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, real, shape, generator=g)
    w_lp = torch.randn(shape, generator=g)
    w_ent = torch.randn(shape, generator=g)
    return logits, targets, w_lp, w_ent


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 4, 33, 4096])
def test_matches_full_log_softmax_values_and_gradients(chunk, temperature):
    """At temperature T: log-probs and entropy of softmax(logits / T), as the rollout server samples."""
    logits, targets, w_lp, w_ent = _data()
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, targets, vocab_size=57, chunk_size=chunk, temperature=temperature)
    (lp * w_lp + ent * w_ent).sum().backward()
    xr = logits.double().requires_grad_()
    rlp, rent = _reference(xr / temperature, targets, 57)
    (rlp * w_lp + rent * w_ent).sum().backward()
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-5, rtol=0)
    assert torch.all(x.grad[..., 57:] == 0)  # padded vocabulary takes no mass and no gradient


def test_without_entropy_and_bf16_inputs_are_fp32():
    logits, targets, w_lp, _ = _data(dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, targets, vocab_size=57, chunk_size=5, with_entropy=False)
    assert ent is None and lp.dtype == torch.float32
    (lp * w_lp).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    rlp, _ = _reference(logits.float(), targets, 57)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=0)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[[1e4, -1e4, 0.0, 5e3]]])
    lp, ent = vocab_parallel_logprobs(logits, torch.tensor([[1]]))
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert lp.item() == pytest.approx(-2e4)


def test_token_alignment():
    logits, _, _, _ = _data(shape=(2, 6))
    ids = torch.randint(0, 57, (2, 6))
    lp, ent = token_aligned_logprobs(logits, ids, vocab_size=57)
    rlp, rent = _reference(logits[:, :-1], ids[:, 1:], 57)
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    torch.testing.assert_close(lp[:, 1:].double(), rlp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[:, 1:].double(), rent, atol=1e-5, rtol=0)


def _tp_shard(rank, world_size, chunk, temperature):
    import torch.distributed as dist

    logits, targets, w_lp, w_ent = _data(seed=5)
    v = logits.shape[-1] // world_size
    x = logits[..., rank * v : (rank + 1) * v].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, targets, tp_group=dist.group.WORLD, vocab_size=57, chunk_size=chunk,
                                      temperature=temperature)
    (lp * w_lp + ent * w_ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("chunk, temperature", [(3, 1.0), (4096, 1.0), (3, 0.6)])
def test_tp2_equals_tp1_values_and_gradients(run_dist, chunk, temperature):
    logits, targets, w_lp, w_ent = _data(seed=5)
    x = logits.clone().requires_grad_()
    lp1, ent1 = vocab_parallel_logprobs(x, targets, vocab_size=57, chunk_size=chunk, temperature=temperature)
    (lp1 * w_lp + ent1 * w_ent).sum().backward()
    res = run_dist(_tp_shard, 2, chunk, temperature, timeout=60)
    for lp2, ent2, _ in res:
        torch.testing.assert_close(lp2, lp1.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent2, ent1.detach(), atol=1e-5, rtol=0)
    grad2 = torch.cat([r[2] for r in res], dim=-1)
    torch.testing.assert_close(grad2, x.grad, atol=1e-5, rtol=0)


def _model_logprobs(rank, world_size, tp):
    from test_actor_helpers import TINY_LLAMA, make_batch

    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    actor = Actor(ActorConfig(parallel=ParallelConfig(tp=tp), logprob_chunk_size=7), TINY_LLAMA)
    return actor.compute_logprobs(make_batch(vocab=120, seed=4))


def test_model_tp2_logprobs_equal_tp1(run_dist):
    """Same weights (megatron's CPU init builds the full master weight, then splits it by TP)."""
    ref = run_dist(_model_logprobs, 1, 1, timeout=120)[0]
    for lp in run_dist(_model_logprobs, 2, 2, timeout=120):
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    assert (ref != 0).sum() > 50


def _backward_ops(with_entropy: bool, use_entropy: bool) -> int:
    """aten ops (other than detach) run by the backward of log-probs (+ entropy) when the loss uses
    the log-probs only (or both)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += func is not torch.ops.aten.detach.default
            return func(*args, **(kwargs or {}))

    logits, targets, w_lp, w_ent = _data()
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, targets, vocab_size=57, chunk_size=8, with_entropy=with_entropy)
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if use_entropy else 0)
    with Count() as count:
        loss.backward()
    return count.ops


def test_an_unused_entropy_costs_nothing_in_backward():
    """The actor logs the entropy but trains on the log-probs: its backward must not run (before the
    fix, autograd handed the backward a zero entropy gradient and it ran in full)."""
    without = _backward_ops(with_entropy=False, use_entropy=False)
    unused = _backward_ops(with_entropy=True, use_entropy=False)
    used = _backward_ops(with_entropy=True, use_entropy=True)
    assert unused == without < used
