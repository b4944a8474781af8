"""The 32B recipe's knobs on real gloo ranks against the single-process padded reference.

Context parallel (padded and packed), sequence parallel, packing, and their combinations with TP,
PP (interleaved too) and DP must give the same log-probs, loss, gradient norm and parameter update as
one process on right-padded micro-batches, at a sampling temperature that is not 1 and with a
sequence-mean loss aggregation (whose per-sequence denominators CP and packing split across ranks
and rows). Every run is under `StrictDevices`, so a host tensor on a group that would be an NCCL
group on GPUs fails the test.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from strict_devices import StrictDevices  # noqa: E402
from test_actor_helpers import full_params, make_batch  # noqa: E402

TEMPERATURE = 0.6


def _actor(hf_dir, tp=1, pp=1, cp=1, sp=False, vpp=None, packing=False, agg="token-mean", budget=10_000, **kw):
    """An actor holding the tiny HF checkpoint's weights (random init differs across PP layouts)."""
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(
        optim=OptimConfig(name="sgd", lr=0.05, clip_grad=0.0),
        parallel=ParallelConfig(tp=tp, pp=pp, cp=cp, sequence_parallel=sp, vpp=vpp),
        max_tokens_per_microbatch=budget, packing=packing, loss_agg=agg, vocab_divisible_by=64,
        use_distributed_optimizer=False, **kw,
    )
    hf_config = AutoConfig.from_pretrained(hf_dir)
    actor = Actor(cfg, hf_config)
    load_hf_into_model(actor.model, hf_dir, hf_config=hf_config)
    return actor


def _step(rank, world_size, hf_dir, layout):
    # Under StrictDevices: megatron's default-backend groups refuse host tensors, as NCCL does.
    with StrictDevices():
        actor = _actor(hf_dir, **layout)
        b = make_batch(num_seqs=8, max_len=23, seed=3, vocab=actor.hf_vocab_size)
        b["temperature"] = TEMPERATURE
        lp = actor.compute_logprobs(b)
        g = torch.Generator().manual_seed(4)
        b["behavior_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
        before = full_params(actor)
        metrics = actor.train_step(b)
        after = full_params(actor)
        return {
            "lp": lp, "metrics": metrics, "lp_after": actor.compute_logprobs(b),
            "update": {k: (after[k] - before[k]).cpu() for k in after}, "cp": actor.layout.cp_size,
        }


def _assert_same(ref, got):
    torch.testing.assert_close(got["lp"], ref["lp"], atol=2e-6, rtol=0)
    for k in ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl_k1", "bapo/c_high", "bapo/c_low",
              "bapo/rho_before", "bapo/rho_after", "bapo/search_steps", "actor/clipfrac", "actor/num_loss_tokens"):
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(got["lp_after"], ref["lp_after"], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def hf4(tmp_path_factory):
    """A tiny HF checkpoint with 4 layers (PP 2 x VPP 2 needs 4 stages)."""
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf4"), seed=0, num_hidden_layers=4))


@pytest.fixture(scope="module", params=["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def reference(request, hf4):
    from dist_harness import run_dist

    return request.param, run_dist(_step, 1, hf4, {"agg": request.param}, timeout=120)[0]


def test_packed_equals_padded_including_gradients(run_dist, reference, hf4):
    agg, ref = reference
    got = run_dist(_step, 1, hf4, {"packing": True, "agg": agg, "budget": 64}, timeout=120)[0]
    _assert_same(ref, got)
    for name, upd in ref["update"].items():  # SGD: the update is -lr * gradient, parameter by parameter
        torch.testing.assert_close(got["update"][name], upd, atol=1e-7, rtol=1e-5, msg=name)
    assert max(u.abs().max() for u in ref["update"].values()) > 1e-4  # a real update was compared


@pytest.mark.parametrize(
    "layout, world_size",
    [  # the inner loop (-m "not slow") keeps TP x CP x packing on 4 ranks; the full suite runs every layout
        pytest.param({"cp": 2}, 2, marks=pytest.mark.slow),
        pytest.param({"cp": 2, "packing": True}, 2, marks=pytest.mark.slow),
        pytest.param({"tp": 2, "sp": True}, 2, marks=pytest.mark.slow),
        pytest.param({"tp": 2, "sp": True, "packing": True}, 2, marks=pytest.mark.slow),
        ({"tp": 2, "cp": 2, "packing": True}, 4),
        pytest.param({"tp": 2, "cp": 2, "sp": True}, 4, marks=pytest.mark.slow),
        pytest.param({"pp": 2, "cp": 2, "packing": True, "budget": 64}, 4, marks=pytest.mark.slow),
        # interleaved: one padded shape per pass; interleaved x CP: global seq_length; DP 2 x CP 2
        pytest.param({"pp": 2, "vpp": 2, "packing": True, "budget": 64}, 2, marks=pytest.mark.slow),
        pytest.param({"pp": 2, "vpp": 2, "cp": 2, "packing": True, "budget": 64}, 4, marks=pytest.mark.slow),
        pytest.param({"cp": 2, "packing": True, "budget": 64}, 4, marks=pytest.mark.slow),
    ],
    ids=lambda v: "-".join(f"{k}{int(x) if isinstance(x, bool) else x}" for k, x in v.items()) if isinstance(v, dict) else str(v),
)
def test_parallel_layout_equals_single_process(run_dist, reference, hf4, layout, world_size):
    agg, ref = reference
    results = run_dist(_step, world_size, hf4, {**layout, "agg": agg}, timeout=240)
    for got in results:
        assert got["cp"] == layout.get("cp", 1)
        _assert_same(ref, got)
    assert all(r["metrics"] == results[0]["metrics"] for r in results)  # identical on every rank
