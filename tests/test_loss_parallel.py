"""DPPO, CISPO and SAPO on real gloo ranks against one process: TP + SP, PP x CP, DP x CP.

The layouts of `test_actor_parallel.py` with the other policy losses: the log-probs, the loss, the
gradient norm, the balance's decision (DPPO's thresholds, CISPO's cap, the positive share) and the
update must equal one process on right-padded micro-batches. The balance runs with rho0 0.8 and
DPPO's thresholds at the scale of the tiny model's probabilities (about 1/100), so every search
moves (and DPPO's masks tokens): equal decisions are not vacuous.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from strict_devices import StrictDevices  # noqa: E402
from test_actor_parallel import TEMPERATURE, _actor  # noqa: E402,F401
from test_actor_helpers import make_batch  # noqa: E402

LOSSES = {
    "dppo": dict(policy_loss="dppo", bapo=dict(rho0=0.8),
                 dppo=dict(delta_low=0.002, delta_high=0.001, low_min=0.0005, low_step=0.0001, high_max=0.004,
                           high_step=0.0002)),
    "cispo": dict(policy_loss="cispo", bapo=dict(rho0=0.8), cispo=dict(c_low=0.2)),
    "sapo": dict(policy_loss="sapo", bapo=dict(low_start=0.8, low_max=0.8, high_start=1.2, high_max=1.2),
                 sapo=dict(tau_pos=1.0, tau_neg=2.0)),
}
KEYS = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl_k1", "actor/clipfrac", "actor/num_loss_tokens",
        "bapo/rho_before", "bapo/rho_after", "bapo/search_steps", "bapo/c_low", "bapo/c_high")


def _step(rank, world_size, hf_dir, layout, loss):
    import torch

    from megatron_bapo.config_io import from_dict
    from megatron_bapo.actor import ActorConfig

    extra = from_dict(ActorConfig, LOSSES[loss], "actor")
    with StrictDevices():
        actor = _actor(hf_dir, policy_loss=extra.policy_loss, bapo=extra.bapo, dppo=extra.dppo, cispo=extra.cispo,
                       sapo=extra.sapo, **layout)
        b = make_batch(num_seqs=8, max_len=23, seed=3, vocab=actor.hf_vocab_size)
        b["temperature"] = TEMPERATURE
        lp = actor.compute_logprobs(b)
        g = torch.Generator().manual_seed(4)
        b["behavior_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
        metrics = actor.train_step(b)
        return {"lp": lp, "metrics": metrics, "lp_after": actor.compute_logprobs(b)}


@pytest.fixture(scope="module")
def hf4(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf4"), seed=0, num_hidden_layers=4))


# The inner loop keeps DPPO (its two-sided search); CISPO and SAPO under DP x CP run in the full suite.
@pytest.fixture(scope="module", params=[name if name == "dppo" else pytest.param(name, marks=pytest.mark.slow)
                                        for name in sorted(LOSSES)])
def reference(request, hf4):
    from dist_harness import run_dist

    return request.param, run_dist(_step, 1, hf4, {"agg": "seq-mean-token-mean"}, request.param, timeout=120)[0]


@pytest.mark.parametrize(
    "layout, world_size",
    [pytest.param({"tp": 2, "sp": True, "packing": True}, 2, marks=pytest.mark.slow),
     pytest.param({"pp": 2, "cp": 2, "packing": True, "budget": 64}, 4, marks=pytest.mark.slow),
     ({"cp": 2, "packing": True, "budget": 64}, 4)],  # DP 2 x CP 2: the balance's group has 4 ranks (inner loop)
    ids=["tp2-sp-packed", "pp2-cp2-packed", "dp2-cp2-packed"],
)
def test_loss_layout_equals_single_process(run_dist, reference, hf4, layout, world_size):
    import torch

    loss, ref = reference
    if loss != "sapo":
        assert ref["metrics"]["bapo/search_steps"] > 0, ref["metrics"]
    if loss == "dppo":
        assert ref["metrics"]["actor/clipfrac"] > 0, ref["metrics"]
    results = run_dist(_step, world_size, hf4, {**layout, "agg": "seq-mean-token-mean"}, loss, timeout=240)
    for got in results:
        torch.testing.assert_close(got["lp"], ref["lp"], atol=2e-6, rtol=0)
        for k in KEYS:
            if k in ref["metrics"]:
                assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), (loss, k)
            else:
                assert k not in got["metrics"], (loss, k)
        torch.testing.assert_close(got["lp_after"], ref["lp_after"], atol=1e-5, rtol=0)
    assert all(r["metrics"] == results[0]["metrics"] for r in results)  # identical on every rank
