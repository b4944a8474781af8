"""The balance the search steers is the applied gradient's, under every `actor.loss_agg`.

The positive share of a step's gradient is, per the spec, `P / (P + N)` with
`P = sum_{A>0} |a_t c_t A_t g_t|`, `N = sum_{A<0} |a_t c_t A_t g_t|`: `a_t` the loss's aggregation
weight (1 per loss token for token-mean and seq-mean-token-sum, `1 / the row's loss tokens` for
seq-mean-token-mean), `c_t` the importance correction and `g_t` the loss's ratio term's derivative
per unit of advantage (PPO: r on passing tokens; DPPO: r on tokens inside the trust region; CISPO:
clip(r, c_low, c_high); SAPO: 4 s (1 - s) r). The reference below writes those out in plain torch,
one full pass per grid point, and never calls the library's weights.

In-process: the search's sums against the literal ones and against the loss's own autograd
gradient, for every mode x loss. Actor: one real megatron step per mode x loss (and with a recomputed
old policy + TIS, and per-micro-batch search) whose logged balance and bounds must equal the literal
reference on the log-probs the step saw. On b74de61 the actor searched with importance corrections
only, so every seq-mean-token-mean case there logs the token-mean share.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_bapo.algorithms import BapoConfig, CispoConfig, DppoConfig, Objective, SapoConfig
from megatron_bapo.algorithms import aggregation_weights, loss_token_weights

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOSSES = {
    "ppo_clip": dict(bapo=dict(rho0=0.8)),
    "dppo": dict(bapo=dict(rho0=0.8), dppo=dict(delta_low=0.002, delta_high=0.001, low_min=0.0005, low_step=0.0001,
                                                 high_max=0.004, high_step=0.0002)),
    "cispo": dict(bapo=dict(rho0=0.8), cispo=dict(c_low=0.2)),
    "sapo": dict(bapo=dict(low_start=0.8, low_max=0.8, high_start=1.2, high_max=1.2), sapo=dict(tau_neg=2.0)),
}


def _objective(name: str) -> Objective:
    kw = LOSSES[name]
    return Objective(name, bapo=BapoConfig(**kw["bapo"]), dppo=DppoConfig(**kw.get("dppo", {})),
                     cispo=CispoConfig(**kw.get("cispo", {})), sapo=SapoConfig(**kw.get("sapo", {})))


# ------------------------------------------------------------------------------- literal reference
def literal_agg(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """a_t, row by row."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        n = int((mask[b] > 0).sum())
        for t in range(mask.shape[1]):
            if mask[b, t] > 0:
                out[b, t] = 1.0 / n if agg == "seq-mean-token-mean" else 1.0
    return out


def literal_term(name: str, obj: Objective, lp, ref, adv, low: float, high: float) -> torch.Tensor:
    """g_t: |d term_t / d logp_t| / |A_t| at parameters (low, high), float64."""
    lp, ref, adv = lp.double(), ref.double(), adv.double()
    r = torch.exp((lp - ref).clamp(-20, 20))
    if name == "ppo_clip":
        c = obj.bapo.dual_clip
        ok_neg = (r >= low) & (r <= c) if c is not None else r >= low
        return torch.where(adv > 0, (r <= high).double() * r, ok_neg.double() * r)
    if name == "dppo":
        assert obj.dppo.divergence == "tv"
        d = lp.exp() - ref.exp()  # Binary-TV: pi - mu
        w = r if obj.dppo.ratio_cap is None else r.clamp(max=obj.dppo.ratio_cap)
        return torch.where(adv > 0, (d <= high).double() * w, (d >= -low).double() * w)
    if name == "cispo":
        return r.clamp(min=obj.cispo.c_low, max=high)
    tau = torch.where(adv > 0, obj.sapo.tau_pos, obj.sapo.tau_neg).double()
    s = torch.sigmoid(tau * (r - 1))
    return 4 * s * (1 - s) * r


def literal_share(name, obj, lp, ref, adv, mask, a, c, low, high) -> tuple[float, float, float]:
    """(share, P, N) of the applied gradient at (low, high)."""
    on = mask > 0
    mass = (a * c * adv.double().abs() * literal_term(name, obj, lp, ref, adv, low, high)).where(on, 0.0)
    P, N = float(mass[on & (adv > 0)].sum()), float(mass[on & (adv < 0)].sum())
    return (1.0 if P + N == 0 else P / (P + N)), P, N


def literal_decision(name, obj, lp, ref, adv, mask, a, c) -> tuple[float, float]:
    """The bounds Algorithm 1 (paper order) picks with the literal share: one full pass per point."""
    b = obj.bapo

    def share(low, high):
        return literal_share(name, obj, lp, ref, adv, mask, a, c, low, high)[0]

    if name == "sapo":
        return float("nan"), float("nan")
    if name == "cispo":  # the cap rises on BAPO's upper grid until the share is met
        k = 0
        while share(0, b.high_start + k * b.high_step) < b.rho0 and b.high_start + (k + 1) * b.high_step <= b.high_max + 1e-9:
            k += 1
        return obj.cispo.c_low, b.high_start + k * b.high_step
    if name == "ppo_clip":
        lows = [b.low_start + j * b.low_step for j in range(int((b.low_max - b.low_start) / b.low_step + 1e-9) + 1)]
        highs = [b.high_start + k * b.high_step for k in range(int((b.high_max - b.high_start) / b.high_step + 1e-9) + 1)]
    else:
        high_max, high_step, low_min, low_step = obj.dppo.search_grid()
        d = obj.dppo
        lows = [d.lower - j * low_step for j in range(int((d.lower - low_min) / low_step + 1e-9) + 1)]
        highs = [d.upper + k * high_step for k in range(int((high_max - d.upper) / high_step + 1e-9) + 1)]
    j = k = 0
    while share(lows[j], highs[k]) < b.rho0 and j + 1 < len(lows):
        if k + 1 < len(highs):
            k += 1
        else:
            j += 1
    return lows[j], highs[k]


def _batch(seed=0, rows=10, cols=30):
    """Rows of different response lengths, the long ones with negative advantages (so token counts and
    sequence means disagree, and the search has negatives to balance); the policy moved a little."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None] < lengths[:, None]).double()
    mask[0] = 0.0  # a row without loss tokens
    ref = torch.log(torch.rand(rows, cols, generator=g, dtype=torch.float64) * 0.02 + 0.002)
    lp = ref + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    size = torch.rand(rows, 1, generator=g, dtype=torch.float64) + 0.5
    adv = torch.where(lengths[:, None] > lengths.median(), -size, size).expand(rows, cols).contiguous()
    corr = torch.rand(rows, cols, generator=g, dtype=torch.float64).clamp(min=0.2)
    corr = corr * (torch.rand(rows, cols, generator=g) < 0.9)  # TIS-like weights, some masked (MIS)
    return lp, ref, adv, mask, corr


# ----------------------------------------------------------------------------------- in process
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("agg", AGGS)
def test_search_counts_the_applied_gradient(name, agg):
    lp, ref, adv, mask, corr = _batch(seed=AGGS.index(agg))
    obj = _objective(name)
    agg_w, denom = aggregation_weights(mask, agg)
    weights = loss_token_weights(agg_w, corr)
    res = obj.search(lp, ref, adv, mask, token_weights=weights)
    a = literal_agg(mask, agg)
    low, high = literal_decision(name, obj, lp, ref, adv, mask, a, corr)
    if name != "sapo":
        assert (res.c_low, res.c_high) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
    start = (obj.bapo.low_start, obj.bapo.high_start) if name == "ppo_clip" else (
        (obj.dppo.lower, obj.dppo.upper) if name == "dppo" else (obj.cispo.c_low, obj.bapo.high_start))
    assert res.rho_initial == pytest.approx(literal_share(name, obj, lp, ref, adv, mask, a, corr, *start)[0], rel=1e-12)
    rho, P, N = literal_share(name, obj, lp, ref, adv, mask, a, corr, res.c_low, res.c_high)
    assert (res.rho, res.pos_contribution, res.neg_contribution) == (
        pytest.approx(rho, rel=1e-12), pytest.approx(P, rel=1e-12), pytest.approx(N, rel=1e-12))
    # The loss's own gradient at the chosen bounds: d loss / d logp_t = -a_t c_t A_t g_t / D.
    x = lp.clone().requires_grad_(True)
    loss, _ = obj.loss(x, ref, adv, mask, (res.c_low, res.c_high), token_weights=weights, denominator=denom)
    loss.backward()
    mass = -x.grad * torch.sign(adv) * denom
    assert float(mass[adv > 0].sum()) == pytest.approx(P, rel=1e-10)
    assert float(mass[adv < 0].sum()) == pytest.approx(N, rel=1e-10)
    if agg == "seq-mean-token-mean":  # not vacuous: counting tokens alone gives another share
        assert abs(literal_share(name, obj, lp, ref, adv, mask, mask, corr, res.c_low, res.c_high)[0] - rho) > 1e-3
    if name != "sapo":
        assert res.num_steps > 0  # the search moved: a decision is compared


# ---------------------------------------------------------------------------------------- actor
CASES = [(name, agg, {}) for name in sorted(LOSSES) for agg in AGGS] + [
    ("ppo_clip", "seq-mean-token-mean", dict(old_logprobs="recompute", correction=dict(mode="tis", tis_cap=1.05))),
    ("cispo", "seq-mean-token-mean", dict(search_scope="microbatch")),
]


def _actor_steps(rank, world_size):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.actor.scatter import prepare_tensors
    from test_actor_helpers import TINY_QWEN2, make_batch

    base = ActorConfig(optim=OptimConfig(name="sgd", lr=0.05, clip_grad=0.0), use_distributed_optimizer=False)
    actor = Actor(base, TINY_QWEN2)
    out = []
    for i, (name, agg, extra) in enumerate(CASES):
        # The step reads these fields of its config (the model and optimizer do not depend on them).
        actor.config = dataclasses.replace(base, policy_loss=name, loss_agg=agg, **LOSSES[name], **extra)
        b = make_batch(num_seqs=8, seed=i)
        lp = actor.compute_logprobs(b)
        b["behavior_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(i))
        data = prepare_tensors(b)
        out.append(dict(lp=lp, beh=data["behavior_logprobs"], adv=data["advantages"], mask=data["loss_mask"],
                        metrics=actor.train_step(b)))
    return out


@pytest.fixture(scope="module")
def actor_steps():
    pytest.importorskip("megatron.core")
    from dist_harness import run_dist

    return run_dist(_actor_steps, 1, timeout=300)[0]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{n}-{a}" + ("-" + "-".join(e) if e else "")
                                                         for n, a, e in CASES])
def test_actor_step_balances_the_applied_gradient(actor_steps, case):
    name, agg, extra = CASES[case]
    step = actor_steps[case]
    lp, beh, adv, mask, m = step["lp"].double(), step["beh"].double(), step["adv"], step["mask"], step["metrics"]
    obj = _objective(name)
    a = literal_agg(mask, agg)
    if extra.get("old_logprobs") == "recompute":  # ratio against the step's own start; c = min(w, cap)
        ref, c = lp, torch.exp(lp - beh).clamp(max=extra["correction"]["tis_cap"])
    else:
        ref, c = beh, torch.ones_like(lp)
    low, high = literal_decision(name, obj, lp, ref, adv, mask, a, c)
    if name == "sapo":
        assert "bapo/c_low" not in m
        low, high = 0.0, 0.0
    else:
        assert (m["bapo/c_low"], m["bapo/c_high"]) == (pytest.approx(low, abs=1e-9), pytest.approx(high, abs=1e-9))
    start = {"ppo_clip": (obj.bapo.low_start, obj.bapo.high_start), "dppo": (obj.dppo.lower, obj.dppo.upper),
             "cispo": (obj.cispo.c_low, obj.bapo.high_start), "sapo": (0.0, 0.0)}[name]
    rho_before = literal_share(name, obj, lp, ref, adv, mask, a, c, *start)[0]
    rho_after = literal_share(name, obj, lp, ref, adv, mask, a, c, low, high)[0]
    assert m["bapo/rho_before"] == pytest.approx(rho_before, rel=1e-5)
    assert m["bapo/rho_after"] == pytest.approx(rho_after, rel=1e-5)
    if agg == "seq-mean-token-mean":  # not vacuous: the token-counting share is another number
        assert abs(literal_share(name, obj, lp, ref, adv, mask, mask, c, *start)[0] - rho_before) > 1e-3
