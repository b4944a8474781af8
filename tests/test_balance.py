"""BAPO's balance for DPPO and CISPO vs literal search loops; SAPO's measured share; ranks agree.

The references re-evaluate the contribution over every token at every search step (numpy, one full
pass per step), with the definitions of `algorithms/balance.py`'s docstring written out; the
implementation does one pass and one collective. They must take the same decision on every random
batch (batches whose balance lands within 1e-9 of rho0 on the path are discarded: there the
decision depends on float summation order). DPPO's coordinate is `dppo.divergence` on both sides
(its formulas are checked in test_policy_losses.py); what is compared is the search.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_bapo.algorithms import BapoConfig
from megatron_bapo.algorithms.balance import dppo_grids, measure_sapo, search_cispo, search_dppo
from megatron_bapo.algorithms.cispo import CispoConfig, cispo_loss
from megatron_bapo.algorithms.dppo import DppoConfig, divergence, dppo_loss
from megatron_bapo.algorithms.sapo import SapoConfig

TIE = 1e-9


def ref_metric(P, N, metric):
    if metric == "share":
        return 1.0 if P + N == 0 else P / (P + N)
    if metric == "printed":
        return (1.0 if P == 0 else math.inf) if P == N else P / abs(P - N)
    return math.inf if N == 0 else P / N


def _weights(lpb, tw, bapo):
    w = np.exp(lpb) if bapo.weight == "rollout_prob" else np.ones_like(lpb)
    return w if tw is None else w * tw


# ---------------------------------------------------------------------------------------------- DPPO
def ref_dppo(lp, mu, a, m, w, dppo, bapo):
    """(delta_low, delta_high, steps, metrics visited): Algorithm 1 / the verl order on DPPO's thresholds."""
    d = divergence(torch.from_numpy(lp), torch.from_numpy(mu), dppo.divergence).numpy()
    r = np.exp(np.clip(lp - mu, -20, 20))
    value = r if dppo.ratio_cap is None else np.minimum(r, dppo.ratio_cap)
    on = m > 0
    visited = []

    def rho(low, high):
        P = float(np.sum((w * np.abs(a) * value)[on & (a > 0) & (d <= high)]))
        N = float(np.sum((w * np.abs(a) * value)[on & (a < 0) & (d >= -low)]))
        visited.append(ref_metric(P, N, bapo.metric))
        return visited[-1]

    low, high = dppo.lower, dppo.upper
    if not bapo.is_adaptive:
        rho(low, high)
        return low, high, 0, visited
    high_max, high_step, low_min, low_step = dppo.search_grid()
    j = k = steps = 0
    if bapo.order == "paper":
        while rho(low, high) < bapo.rho0 and dppo.lower - (j + 1) * low_step >= low_min - 1e-9:
            if dppo.upper + (k + 1) * high_step <= high_max + 1e-9:
                k += 1
                high = dppo.upper + k * high_step
            else:
                j += 1
                low = -(-dppo.lower + j * low_step)
            steps += 1
        return low, high, steps, visited
    met = rho(low, high) >= bapo.rho0
    while not met and low > low_min + 1e-9:
        j += 1
        low = max(-(-dppo.lower + j * low_step), low_min)
        steps += 1
        met = rho(low, high) >= bapo.rho0
    while not met and high < high_max - 1e-9:
        k += 1
        high = min(dppo.upper + k * high_step, high_max)
        steps += 1
        met = rho(low, high) >= bapo.rho0
    return low, high, steps, visited


@st.composite
def batches(draw):
    n = draw(st.integers(min_value=1, max_value=64))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    mu = np.log(g.uniform(0.01, 0.99, n))
    spread = draw(st.sampled_from([0.1, 0.5, 1.5]))
    lp = np.minimum(mu + g.normal(0.0, spread, n), -1e-4)
    a = {"normal": g.normal(0.0, 1.0, n), "pos": g.uniform(0.1, 2.0, n), "neg": -g.uniform(0.1, 2.0, n),
         "zeros": np.zeros(n)}[draw(st.sampled_from(["normal", "normal", "pos", "neg", "zeros"]))]
    m = (g.random(n) < draw(st.sampled_from([1.0, 0.7, 0.0]))).astype(np.float64)
    lpb = np.log(g.uniform(0.01, 1.0, n))
    tw = {"none": None, "tis": np.minimum(np.exp(g.normal(0, 0.6, n)), 2.0),
          "mask": (g.random(n) < 0.7).astype(np.float64)}[draw(st.sampled_from(["none", "tis", "mask"]))]
    return lp, mu, a, m, lpb, tw


bapos = st.builds(BapoConfig, rho0=st.sampled_from([0.2, 0.4, 0.5, 0.7]), weight=st.sampled_from(["none", "rollout_prob"]),
                  metric=st.sampled_from(["share", "printed", "pos_neg"]), order=st.sampled_from(["paper", "verl"]))
dppos = st.builds(DppoConfig, divergence=st.sampled_from(["tv", "kl"]), ratio_cap=st.sampled_from([None, 2.0]),
                  high_max=st.sampled_from([None, 0.37]), low_step=st.sampled_from([None, 0.007]))


def _t(x):
    return None if x is None else torch.from_numpy(np.asarray(x, dtype=np.float64))


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), dppo=dppos, bapo=bapos, adaptive=st.booleans())
def test_dppo_search_equals_literal_loop(batch, dppo, bapo, adaptive):
    lp, mu, a, m, lpb, tw = batch
    if not adaptive:
        bapo = bapo.replace(low_max=bapo.low_start, high_max=bapo.high_start)
    low, high, steps, visited = ref_dppo(lp, mu, a, m, _weights(lpb, tw, bapo), dppo, bapo)
    assume(all(abs(v - bapo.rho0) > TIE * (1 + bapo.rho0) for v in visited if math.isfinite(v)))
    got = search_dppo(_t(lp), _t(mu), _t(a), _t(m), dppo, bapo, rollout_logprobs=_t(lpb), token_weights=_t(tw))
    assert got.num_steps == steps
    assert got.c_low == pytest.approx(low, abs=1e-12) and got.c_high == pytest.approx(high, abs=1e-12)
    assert got.rho_initial == pytest.approx(visited[0], rel=1e-9, abs=1e-12)
    assert got.rho == pytest.approx(visited[-1], rel=1e-9, abs=1e-12)


def test_dppo_tie_convention_is_the_losss():
    """A token exactly on a threshold passes (in the search and in the loss) and one just past it
    does not: the searched thresholds meet the loss's comparisons on the same float64 values."""
    mu = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64))
    d = torch.tensor([0.25, 0.25, -0.1, -0.1], dtype=torch.float64)
    lp = torch.log(mu.exp() + d)
    on_grid = divergence(lp, mu, "tv")  # the exact float64 values both sides compare
    high = float(on_grid[0])
    cfg = DppoConfig(delta_low=-float(on_grid[2]), delta_high=high)
    a = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    fixed = BapoConfig.preset("grpo")
    res = search_dppo(lp, mu, a, torch.ones(4, dtype=torch.float64), cfg, fixed)
    x = lp.clone().requires_grad_(True)
    _, stats = dppo_loss(x, mu, a, torch.ones(4, dtype=torch.float64), cfg)
    assert stats["num_clipped_pos"] == 0 and stats["num_clipped_neg"] == 0  # on the threshold: passes
    assert res.pos_contribution > 0 and res.neg_contribution > 0
    nudged = cfg.__class__(delta_low=cfg.lower, delta_high=float(np.nextafter(high, 0)))
    _, stats = dppo_loss(x, mu, a, torch.ones(4, dtype=torch.float64), nudged)
    assert stats["num_clipped_pos"] == 2
    assert search_dppo(lp, mu, a, torch.ones(4, dtype=torch.float64), nudged, fixed).pos_contribution == 0.0


@settings(max_examples=300, deadline=None)
@given(batch=batches(), kind=st.sampled_from(["tv", "kl"]))
def test_dppo_balance_never_decreases_along_the_path(batch, kind):
    """Raising delta_high only admits positives, lowering delta_low only masks negatives."""
    lp, mu, a, m, lpb, tw = batch
    dppo, bapo = DppoConfig(divergence=kind), BapoConfig(rho0=1.0)  # rho0 = 1 walks the whole path
    _, _, _, visited = ref_dppo(lp, mu, a, m, _weights(lpb, tw, bapo), dppo, bapo)
    assert all(b >= a_ - 1e-12 for a_, b in zip(visited, visited[1:]))
    if visited[-1] < 1.0:  # unmet: the walk covered every grid point of the path
        assert len(visited) == sum(g.numel() for g in dppo_grids(dppo, bapo)) - 1


def test_dppo_search_moves_the_thresholds_when_negatives_dominate():
    g = torch.Generator().manual_seed(0)
    mu = torch.log(torch.rand(4000, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp = (mu + torch.randn(4000, generator=g, dtype=torch.float64) * 0.5).clamp(max=-1e-4)
    a = torch.where(torch.rand(4000, generator=g) < 0.4, 1.0, -1.0).double()  # 40% positive tokens
    res = search_dppo(lp, mu, a, torch.ones(4000), DppoConfig(), BapoConfig())
    assert res.rho_initial < 0.4 <= res.rho and res.num_steps > 0
    assert res.c_high > 0.15


# --------------------------------------------------------------------------------------------- CISPO
def ref_cispo(lp, mu, a, m, w, cispo, bapo):
    r = np.exp(np.clip(lp - mu, -20, 20))
    on = m > 0
    if bapo.is_adaptive:
        grid = [bapo.high_start + k * bapo.high_step for k in range(bapo.num_high_steps + 1)]
        if bapo.order == "verl" and bapo.high_max - grid[-1] > 1e-9:
            grid.append(bapo.high_max)
    else:
        grid = [cispo.c_high]
    visited = []
    for k, cap in enumerate(grid):
        weight = np.clip(r, cispo.c_low, cap)
        P = float(np.sum((w * np.abs(a) * weight)[on & (a > 0)]))
        N = float(np.sum((w * np.abs(a) * weight)[on & (a < 0)]))
        visited.append(ref_metric(P, N, bapo.metric))
        if visited[-1] >= bapo.rho0:
            break
    return grid[k], k, visited


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), bapo=bapos, c_low=st.sampled_from([0.0, 0.5]), adaptive=st.booleans())
def test_cispo_search_equals_literal_loop(batch, bapo, c_low, adaptive):
    lp, mu, a, m, lpb, tw = batch
    if not adaptive:
        bapo = bapo.replace(low_max=bapo.low_start, high_max=bapo.high_start)
    cispo = CispoConfig(c_low=c_low, c_high=1.6)
    cap, steps, visited = ref_cispo(lp, mu, a, m, _weights(lpb, tw, bapo), cispo, bapo)
    assume(all(abs(v - bapo.rho0) > TIE * (1 + bapo.rho0) for v in visited if math.isfinite(v)))
    got = search_cispo(_t(lp), _t(mu), _t(a), _t(m), cispo, bapo, rollout_logprobs=_t(lpb), token_weights=_t(tw))
    assert (got.num_steps, got.c_low) == (steps, c_low)
    assert got.c_high == pytest.approx(cap, abs=1e-12)
    assert got.rho_initial == pytest.approx(visited[0], rel=1e-9, abs=1e-12)
    assert got.rho == pytest.approx(visited[-1], rel=1e-9, abs=1e-12)


def test_cispo_contribution_is_the_losss_gradient_mass():
    """P and N at the chosen cap are the sizes of the loss's per-token gradients (x the token mean)."""
    g = torch.Generator().manual_seed(1)
    mu = torch.log(torch.rand(300, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp = (mu + torch.randn(300, generator=g, dtype=torch.float64) * 0.6).clamp(max=-1e-4)
    a = torch.randn(300, generator=g, dtype=torch.float64)
    mask = torch.ones(300, dtype=torch.float64)
    cispo, bapo = CispoConfig(c_low=0.3), BapoConfig(rho0=0.9)
    res = search_cispo(lp, mu, a, mask, cispo, bapo)
    x = lp.clone().requires_grad_(True)
    cispo_loss(x, mu, a, mask, cispo, c_high=res.c_high)[0].backward()
    mass = -x.grad * 300  # token mean: d loss / d logp_t = -clip(r) A / n
    assert res.pos_contribution == pytest.approx(float(mass[a > 0].sum()), rel=1e-10)
    assert res.neg_contribution == pytest.approx(float(-mass[a < 0].sum()), rel=1e-10)


def test_sapo_share_is_its_gradient_mass():
    from megatron_bapo.algorithms.sapo import sapo_loss

    g = torch.Generator().manual_seed(2)
    mu = torch.log(torch.rand(200, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp = mu + torch.randn(200, generator=g, dtype=torch.float64) * 0.5
    a = torch.randn(200, generator=g, dtype=torch.float64)
    mask = (torch.rand(200, generator=g) < 0.8).double()
    res = measure_sapo(lp, mu, a, mask, SapoConfig(), BapoConfig.preset("grpo"))
    x = lp.clone().requires_grad_(True)
    sapo_loss(x, mu, a, mask, SapoConfig())[0].backward()
    mass = -x.grad * mask.sum()
    assert res.pos_contribution == pytest.approx(float(mass[a > 0].sum()), rel=1e-10)
    assert res.neg_contribution == pytest.approx(float(-mass[a < 0].sum()), rel=1e-10)
    assert math.isnan(res.c_low) and res.num_steps == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_loss_tokens_raise_and_padding_is_ignored(bad):
    lp = torch.log(torch.tensor([0.3, 0.4, 0.5], dtype=torch.float64))
    mu = torch.log(torch.tensor([0.3, 0.5, 0.5], dtype=torch.float64))
    a = torch.tensor([1.0, -1.0, bad], dtype=torch.float64)
    for fn, cfg in ((search_dppo, DppoConfig()), (search_cispo, CispoConfig()), (measure_sapo, SapoConfig())):
        res = fn(lp, mu, a, torch.tensor([1.0, 1.0, 0.0]), cfg, BapoConfig.preset("grpo"))
        assert res.num_tokens == 2
        with pytest.raises(ValueError, match="NaN/inf"):
            fn(lp, mu, a, torch.ones(3), cfg, BapoConfig.preset("grpo"))
    # The actor asks not to raise (the last pipeline stage alone knows; the stages agree on skipping):
    # the start parameters come back with the count, for every loss.
    from megatron_bapo.algorithms.objective import Objective

    for name in ("ppo_clip", "dppo", "cispo", "sapo"):
        objective = Objective(name, bapo=BapoConfig.preset("grpo"))
        res = objective.search(lp, mu, a, torch.ones(3), raise_nonfinite=False)
        assert res.num_nonfinite == 1 and res.num_steps == 0, name
        with pytest.raises(ValueError, match="NaN/inf"):
            objective.search(lp, mu, a, torch.ones(3))


# ------------------------------------------------------------------------------------- across ranks
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce", "reduce_scatter", "barrier",
               "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor")


def _shard(rank, n=3000, seed=11):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    size = n + 41 * rank
    mu = torch.log(torch.rand(size, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp = (mu + torch.randn(size, generator=g, dtype=torch.float64) * (0.3 + 0.2 * rank)).clamp(max=-1e-4)
    a = torch.randn(size, generator=g, dtype=torch.float64) + (0.2 if rank == 0 else -0.6)
    mask = (torch.rand(size, generator=g) < 0.9).double()
    return lp, mu, a, mask


SEARCHES = {"dppo": (search_dppo, DppoConfig()), "dppo_kl_verl": (search_dppo, DppoConfig(divergence="kl")),
            "cispo": (search_cispo, CispoConfig()), "sapo": (measure_sapo, SapoConfig())}


def _worker(rank, world_size):
    calls = []
    originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES}

    def counting(name):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return wrapped

    group = torch.distributed.new_group(list(range(world_size)))
    for name in COLLECTIVES:
        setattr(torch.distributed, name, counting(name))
    out = {}
    try:
        for key, (fn, cfg) in SEARCHES.items():
            bapo = BapoConfig(order="verl") if key.endswith("verl") else BapoConfig()
            if key == "sapo":
                bapo = BapoConfig.preset("grpo")
            before = len(calls)
            out[key] = (fn(*_shard(rank), cfg, bapo, group=group), calls[before:])
    finally:
        for name, fn in originals.items():
            setattr(torch.distributed, name, fn)
    return out


def test_ranks_agree_with_one_collective_and_equal_one_process(run_dist):
    results = run_dist(_worker, 3, timeout=180)
    shards = [_shard(r) for r in range(3)]
    full = [torch.cat([s[i] for s in shards]) for i in range(4)]
    for key, (fn, cfg) in SEARCHES.items():
        per_rank = [results[r][key] for r in range(3)]
        assert all(calls == ["all_reduce"] for _, calls in per_rank), key
        decisions = {(res.c_low, res.c_high, res.num_steps, res.rho, res.pos_contribution) for res, _ in per_rank}
        assert len(decisions) == 1 or key == "sapo" and len({(r.rho, r.pos_contribution) for r, _ in per_rank}) == 1
        bapo = BapoConfig(order="verl") if key.endswith("verl") else BapoConfig()
        single = fn(*full, cfg, BapoConfig.preset("grpo") if key == "sapo" else bapo)
        got = per_rank[0][0]
        assert (got.num_steps, got.num_tokens) == (single.num_steps, single.num_tokens), key
        assert got.rho == pytest.approx(single.rho, rel=1e-12), key
        if key != "sapo":
            assert (got.c_low, got.c_high) == (single.c_low, single.c_high), key
            assert got.num_steps > 0, key  # the search moved: the comparison is not vacuous
