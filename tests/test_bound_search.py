"""BAPO bound search vs an independent, literal transcription of the search loops.

The reference below re-evaluates the contribution over every token at every step (one full pass
per step, numpy, formulas straight from design §4 / the paper's Algorithm 1 / the official
recipe). The implementation under test does one pass and one collective. They must take the same
decision on every random batch, including batches whose tokens carry importance weights (the
`algorithms.importance` corrections: truncated, masked to zero, arbitrary), which the reference
multiplies into every token's contribution as the loss multiplies them into its term. Batches whose balance lands within 1e-9 of rho0 somewhere on the
path are discarded: there the decision depends on float summation order, which neither side
defines.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_bapo.algorithms import BapoConfig, balance_metric, search_clip_bounds
from megatron_bapo.algorithms.bound_search import bound_grid
from megatron_bapo.algorithms.contribution_bins import contribution_vectors

TIE = 1e-9


# ----------------------------------------------------------------------------------------------
# Independent reference: one full pass over the tokens per search step.
# ----------------------------------------------------------------------------------------------
def ref_contributions(r, a, m, w, c_low, c_high, cfg, bound_dtype=np.float64):
    r, a, m, w = (np.asarray(x, dtype=np.float64) for x in (r, a, m, w))
    # Ratios are compared with the bounds as the ratio's dtype holds them (the loss does the same).
    cmp_low, cmp_high = float(bound_dtype(c_low)), float(bound_dtype(c_high))
    on = m > 0
    if cfg.contribution == "gradient":
        pos = on & (a > 0) & (r <= cmp_high)
        neg = on & (a < 0) & (r >= cmp_low)
        if cfg.dual_clip is not None:
            neg &= r <= cfg.dual_clip
        P = float(np.sum(w[pos] * a[pos] * r[pos]))
        N = float(np.sum(w[neg] * np.abs(a[neg]) * r[neg]))
    else:
        pos = on & (a > 0)
        neg = on & (a < 0)
        # min(r, c_high) and max(r, c_low), with the clipped side decided in the ratio's dtype.
        P = float(np.sum(w[pos] * a[pos] * np.where(r[pos] <= cmp_high, r[pos], c_high)))
        N = float(np.sum(w[neg] * np.abs(a[neg]) * np.where(r[neg] >= cmp_low, r[neg], c_low)))
    return P, N


def ref_metric(P, N, metric):
    if metric == "share":
        return 1.0 if P + N == 0 else P / (P + N)
    if metric == "printed":
        return (1.0 if P == 0 else math.inf) if P == N else P / abs(P - N)
    return math.inf if N == 0 else P / N


def ref_search(r, a, m, w, cfg, bound_dtype=np.float64):
    """Returns (c_low, c_high, steps, metrics visited)."""
    visited = []

    def rho(c_low, c_high):
        value = ref_metric(*ref_contributions(r, a, m, w, c_low, c_high, cfg, bound_dtype), cfg.metric)
        visited.append(value)
        return value

    j = k = steps = 0
    if cfg.order == "paper":
        c_low, c_high = cfg.low_start, cfg.high_start
        # Algorithm 1, with bounds recomputed from integer step counts instead of accumulated.
        while rho(c_low, c_high) < cfg.rho0 and cfg.low_start + (j + 1) * cfg.low_step <= cfg.low_max + 1e-9:
            if cfg.high_start + (k + 1) * cfg.high_step <= cfg.high_max + 1e-9:
                k += 1
                c_high = cfg.high_start + k * cfg.high_step
            else:
                j += 1
                c_low = cfg.low_start + j * cfg.low_step
            steps += 1
        return c_low, c_high, steps, visited
    # Official recipe: c_low = min(c_low + step, max) while unmet, then the same for c_high.
    c_low, c_high = cfg.low_start, cfg.high_start
    met = rho(c_low, c_high) >= cfg.rho0
    while not met and c_low < cfg.low_max - 1e-9:
        j += 1
        c_low = min(cfg.low_start + j * cfg.low_step, cfg.low_max)
        steps += 1
        met = rho(c_low, c_high) >= cfg.rho0
    while not met and c_high < cfg.high_max - 1e-9:
        k += 1
        c_high = min(cfg.high_start + k * cfg.high_step, cfg.high_max)
        steps += 1
        met = rho(c_low, c_high) >= cfg.rho0
    return c_low, c_high, steps, visited


# ----------------------------------------------------------------------------------------------
# Random batches
# ----------------------------------------------------------------------------------------------
GRID_POINTS = [0.6, 0.62, 0.7, 0.9, 1.2, 1.25, 1.5, 3.0, 3.05]


@st.composite
def batches(draw):
    n = draw(st.integers(min_value=1, max_value=64))
    spread = draw(st.sampled_from([0.05, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    r = np.exp(g.normal(0.0, spread, n))
    # Some ratios exactly on grid values, to pin the tie convention.
    on_grid = g.random(n) < draw(st.sampled_from([0.0, 0.2]))
    r[on_grid] = g.choice(GRID_POINTS, on_grid.sum())
    adv_kind = draw(st.sampled_from(["normal", "binary", "pos_only", "neg_only", "zeros"]))
    if adv_kind == "normal":
        a = g.normal(0.0, 1.0, n)
    elif adv_kind == "binary":
        a = g.choice([-1.0, 1.0], n) * g.uniform(0.5, 1.5)
    elif adv_kind == "pos_only":
        a = g.uniform(0.1, 2.0, n)
    elif adv_kind == "neg_only":
        a = -g.uniform(0.1, 2.0, n)
    else:
        a = np.zeros(n)
    m = (g.random(n) < draw(st.sampled_from([1.0, 0.7, 0.0]))).astype(np.float64)
    logp_behavior = np.log(g.uniform(0.01, 1.0, n))
    # Importance corrections as `algorithms.importance` makes them: none, TIS (min(w, 2)), MIS (w in
    # [0.5, 2] else 0), sequence masks (0/1), arbitrary non-negative weights.
    w_kind = draw(st.sampled_from(["none", "tis", "mis", "mask", "any"]))
    w = np.exp(g.normal(0.0, 0.6, n))
    weights = {"none": None, "tis": np.minimum(w, 2.0), "mis": np.where((w >= 0.5) & (w <= 2.0), w, 0.0),
               "mask": (g.random(n) < 0.7).astype(np.float64), "any": g.uniform(0.0, 3.0, n)}[w_kind]
    return r, a, m, logp_behavior, weights


configs = st.builds(
    BapoConfig,
    rho0=st.sampled_from([0.2, 0.4, 0.5, 0.7]),
    contribution=st.sampled_from(["gradient", "surrogate"]),
    weight=st.sampled_from(["none", "rollout_prob"]),
    metric=st.sampled_from(["share", "printed", "pos_neg"]),
    order=st.sampled_from(["paper", "verl"]),
    dual_clip=st.sampled_from([3.0, None, 1.5]),
)


def _run(r, a, m, lpb, tw, cfg):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return search_clip_bounds(t(r), t(a), t(m), cfg, rollout_logprobs=t(lpb),
                              token_weights=None if tw is None else t(tw))


def _ref_weights(lpb, tw, cfg):
    """The reference's per-token weight: rollout probability (weight: rollout_prob) x importance weight."""
    w = np.exp(np.asarray(lpb, dtype=np.float64)) if cfg.weight == "rollout_prob" else np.ones(np.shape(lpb))
    return w if tw is None else w * np.asarray(tw, dtype=np.float64)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), cfg=configs)
def test_search_equals_literal_algorithm(batch, cfg):
    r, a, m, lpb, tw = batch
    w = _ref_weights(lpb, tw, cfg)
    ref_low, ref_high, ref_steps, visited = ref_search(r, a, m, w, cfg)
    assume(all(abs(v - cfg.rho0) > TIE * (1 + cfg.rho0) for v in visited if math.isfinite(v)))
    got = _run(r, a, m, lpb, tw, cfg)
    assert got.num_steps == ref_steps
    assert got.c_low == pytest.approx(ref_low, abs=1e-12)
    assert got.c_high == pytest.approx(ref_high, abs=1e-12)
    assert got.rho_initial == pytest.approx(visited[0], rel=1e-9, abs=1e-12)
    assert got.rho == pytest.approx(visited[-1], rel=1e-9, abs=1e-12)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), cfg=configs)
def test_float32_search_equals_literal_algorithm(batch, cfg):
    """float32 inputs take the float32 working path (arithmetic bin index, exact float64 products);
    the reference sees the same float32 values and float32-rounded bounds."""
    r, a, m, lpb, tw = (None if x is None else np.asarray(x, dtype=np.float32) for x in batch)
    w = _ref_weights(lpb, tw, cfg)
    ref_low, ref_high, ref_steps, visited = ref_search(r, a, m, w, cfg, bound_dtype=np.float32)
    assume(all(abs(v - cfg.rho0) > 1e-6 * (1 + cfg.rho0) for v in visited if math.isfinite(v)))
    t = lambda x: torch.from_numpy(x)  # noqa: E731
    got = search_clip_bounds(t(r), t(a), t(m), cfg, rollout_logprobs=t(lpb),
                             token_weights=None if tw is None else t(tw))
    assert (got.num_steps, got.c_low, got.c_high) == (ref_steps, pytest.approx(ref_low, abs=1e-12),
                                                       pytest.approx(ref_high, abs=1e-12))
    assert got.rho == pytest.approx(visited[-1], rel=1e-6, abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(batch=batches(), weight=st.sampled_from(["none", "rollout_prob"]), dual=st.sampled_from([3.0, None]))
def test_gradient_balance_is_monotone_along_the_path(batch, weight, dual):
    """Raising c_high only adds positives, raising c_low only removes negatives (design §4)."""
    r, a, m, lpb, tw = batch
    cfg = BapoConfig(weight=weight, dual_clip=dual, rho0=1.0)  # rho0=1 walks the whole path
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    hg = bound_grid(cfg.high_start, cfg.high_max, cfg.high_step, clamp_to_stop=False)
    lg = bound_grid(cfg.low_start, cfg.low_max, cfg.low_step, clamp_to_stop=False)
    vec = contribution_vectors(t(r), t(a), t(m), cfg, hg, lg, t(lpb),
                               token_weights=None if tw is None else t(tw)).tolist()
    P, N = vec[: hg.numel()], vec[hg.numel() : hg.numel() + lg.numel()]
    assert all(P[i + 1] >= P[i] for i in range(len(P) - 1))
    assert all(N[i + 1] <= N[i] for i in range(len(N) - 1))
    # Along the paper path the share never decreases.
    k = j = 0
    prev = balance_metric(P[0], N[0], "share")
    while j + 1 < len(N):
        if k + 1 < len(P):
            k += 1
        else:
            j += 1
        cur = balance_metric(P[k], N[j], "share")
        assert cur >= prev - 1e-12
        prev = cur


def _t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_no_positive_tokens_walks_to_the_end_of_the_path():
    cfg = BapoConfig()
    res = search_clip_bounds(_t([1.0, 0.7]), _t([-1.0, -2.0]), _t([1, 1]), cfg)
    assert res.rho_initial == 0.0 and res.rho == 0.0
    assert res.c_high == pytest.approx(cfg.high_max) and res.c_low == pytest.approx(cfg.low_max)
    assert res.num_steps == cfg.num_high_steps + cfg.num_low_steps


@pytest.mark.parametrize("metric", ["share", "printed", "pos_neg"])
def test_no_negative_tokens_keeps_the_start_bounds(metric):
    res = search_clip_bounds(_t([1.0, 2.0]), _t([1.0, 0.5]), _t([1, 1]), BapoConfig(metric=metric))
    assert (res.c_low, res.c_high, res.num_steps) == (0.6, 1.2, 0)


@pytest.mark.parametrize("metric", ["share", "printed", "pos_neg"])
def test_all_masked_or_zero_advantages_is_balanced(metric):
    cfg = BapoConfig(metric=metric)
    for adv, mask in (([1.0, -1.0], [0, 0]), ([0.0, 0.0], [1, 1])):
        res = search_clip_bounds(_t([1.3, 0.5]), _t(adv), _t(mask), cfg)
        assert (res.c_low, res.c_high, res.num_steps) == (0.6, 1.2, 0)
        assert res.pos_contribution == 0.0 and res.neg_contribution == 0.0


def test_one_token():
    # A lone clipped positive token: P = N = 0, nothing to balance (share is 1 by definition).
    res = search_clip_bounds(_t([2.0]), _t([1.0]), _t([1]), BapoConfig())
    assert (res.c_low, res.c_high, res.num_steps, res.rho) == (0.6, 1.2, 0, 1.0)


def test_clipped_positive_is_released_when_the_balance_needs_it():
    # The positive token (r=2.0) passes no gradient until c_high reaches 2.0, 16 steps up the grid.
    res = search_clip_bounds(_t([2.0, 1.0]), _t([1.0, -1.0]), _t([1, 1]), BapoConfig())
    assert res.c_high == pytest.approx(2.0) and res.c_low == 0.6
    assert res.rho == pytest.approx(2.0 / 3.0) and res.num_steps == 16


def test_empty_batch():
    res = search_clip_bounds(_t([]), _t([]), _t([]), BapoConfig())
    assert res.num_tokens == 0 and res.num_steps == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["ratio", "advantages", "rollout"])
def test_nonfinite_inputs_raise(bad, where):
    r, a, lp = [1.0, 1.1], [0.5, -0.5], [-1.0, -2.0]
    {"ratio": r, "advantages": a, "rollout": lp}[where][1] = bad
    cfg = BapoConfig(weight="rollout_prob")
    with pytest.raises(ValueError, match="NaN/inf"):
        search_clip_bounds(_t(r), _t(a), _t([1, 1]), cfg, rollout_logprobs=_t(lp))


def test_nonfinite_values_in_masked_padding_are_ignored():
    res = search_clip_bounds(_t([1.0, math.nan]), _t([1.0, math.inf]), _t([1, 0]), BapoConfig(),
                             token_weights=_t([1.0, math.nan]))
    assert res.num_tokens == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_token_weight_on_a_loss_token_raises(bad):
    with pytest.raises(ValueError, match="weight"):
        search_clip_bounds(_t([1.0, 1.1]), _t([0.5, -0.5]), _t([1, 1]), BapoConfig(), token_weights=_t([1.0, bad]))


def test_weighted_contributions_by_hand():
    """P and N sum w |A| r over the tokens that pass gradient; a weight-0 token counts for nothing."""
    cfg = BapoConfig(dual_clip=None)
    hg = bound_grid(cfg.high_start, cfg.high_max, cfg.high_step, clamp_to_stop=False)
    lg = bound_grid(cfg.low_start, cfg.low_max, cfg.low_step, clamp_to_stop=False)
    r, a, w = _t([1.1, 1.0, 0.9, 0.7]), _t([2.0, 1.0, -1.0, -3.0]), _t([0.5, 0.0, 2.0, 1.5])
    vec = contribution_vectors(r, a, _t([1, 1, 1, 1]), cfg, hg, lg, token_weights=w)
    P, N = vec[0].item(), vec[hg.numel()].item()  # c_high = 1.2, c_low = 0.6: every token passes
    assert P == pytest.approx(0.5 * 2.0 * 1.1)
    assert N == pytest.approx(2.0 * 1.0 * 0.9 + 1.5 * 3.0 * 0.7)
    res = search_clip_bounds(r, a, _t([1, 1, 1, 1]), cfg, token_weights=w)
    assert res.pos_contribution == pytest.approx(P) and res.rho_initial == pytest.approx(P / (P + N))


def test_shape_and_weight_errors_name_the_argument():
    with pytest.raises(ValueError, match="same shape"):
        search_clip_bounds(_t([1.0]), _t([1.0, 2.0]), _t([1, 1]), BapoConfig())
    with pytest.raises(ValueError, match="rollout_logprobs"):
        search_clip_bounds(_t([1.0]), _t([1.0]), _t([1]), BapoConfig(weight="rollout_prob"))
    with pytest.raises(ValueError, match="token_weights"):
        search_clip_bounds(_t([1.0]), _t([1.0]), _t([1]), BapoConfig(), token_weights=_t([1.0, 2.0]))


def test_float32_inputs_and_grid_never_accumulates_floats():
    cfg = BapoConfig()
    grid = bound_grid(cfg.high_start, cfg.high_max, cfg.high_step, clamp_to_stop=False)
    assert grid.numel() == 37 and grid[-1].item() == 1.2 + 36 * 0.05
    lg = bound_grid(0.8, 0.95, 0.05, clamp_to_stop=True)
    assert lg.tolist() == [0.8, 0.8 + 0.05, 0.8 + 2 * 0.05, 0.8 + 3 * 0.05]
    clamped = bound_grid(1.2, 2.05, 0.1, clamp_to_stop=True)
    assert clamped.tolist()[-1] == 2.05
    g = torch.Generator().manual_seed(0)
    r = torch.exp(torch.randn(1000, generator=g) * 0.3)
    a = torch.randn(1000, generator=g)
    res32 = search_clip_bounds(r.float(), a.float(), torch.ones(1000), cfg)
    res64 = search_clip_bounds(r.double(), a.double(), torch.ones(1000), cfg)
    assert (res32.c_low, res32.c_high) == (res64.c_low, res64.c_high)


GRIDS = {
    "paper": dict(low_start=0.6, low_max=0.9, low_step=0.02, high_start=1.2, high_max=3.0, high_step=0.05),
    "verl-clamped": dict(low_start=0.8, low_max=0.97, low_step=0.05, high_start=1.2, high_max=2.05, high_step=0.1,
                         order="verl"),
    "tiny-step": dict(low_start=0.99, low_max=0.995, low_step=0.0001, high_start=1.0, high_max=1.01, high_step=0.0001),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_bin_index_is_exact_on_and_around_every_grid_value(dtype, grid):
    """The arithmetic bin index equals searchsorted (strict for positive tokens on the high grid,
    inclusive for negative ones on the low grid) on values exactly on, one ulp beside and between
    grid values, and past both ends. Clamped grids and coarse dtypes with a tiny step take the
    searchsorted path; both paths are checked."""
    from megatron_bapo.algorithms.contribution_bins import _BinIndex, _Workspace

    cfg = BapoConfig(**GRIDS[grid])
    clamp = cfg.order == "verl"
    high64 = bound_grid(cfg.high_start, cfg.high_max, cfg.high_step, clamp_to_stop=clamp)
    low64 = bound_grid(cfg.low_start, cfg.low_max, cfg.low_step, clamp_to_stop=clamp)
    binner = _BinIndex(high64, low64, cfg, dtype, torch.device("cpu"))
    big = 1e30 if dtype != torch.float16 else 6e4
    probes = []
    for g64, step in ((high64, cfg.high_step), (low64, cfg.low_step)):
        g = g64.to(dtype)
        probes += [g, torch.nextafter(g, g + 1), torch.nextafter(g, g - 1), (g[:-1] + g[1:]) / 2,
                   g.new_tensor([0.0, float(g64[0]) - step, float(g64[-1]) + step, big])]
    r = torch.cat(probes)
    r = torch.cat([r, r])
    neg = torch.cat([torch.zeros(r.numel() // 2), -torch.ones(r.numel() // 2)]).to(binner.work)
    high, low = high64.to(dtype), low64.to(dtype)
    expected = torch.where(neg < 0, torch.searchsorted(low, r, right=True) + high.numel() + 1,
                           torch.searchsorted(high, r))
    ws = _Workspace.get(r.numel(), binner.work, torch.float32, r.device).view(r.numel())
    got = binner.index(r.to(binner.work), neg, ws)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if dtype in (torch.float32, torch.float64) and grid == "paper":
        assert binner.fast
    if grid == "verl-clamped" or (grid == "tiny-step" and dtype in (torch.bfloat16, torch.float16)):
        assert not binner.fast


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64, torch.float64])
def test_mask_dtypes_and_non_unit_values_mean_in_or_out(mask_dtype):
    """Any nonzero mask value puts a token in the loss, whatever the mask's dtype (as bool() would)."""
    g = torch.Generator().manual_seed(3)
    r = torch.exp(torch.randn(500, generator=g) * 0.3)
    a = torch.randn(500, generator=g)
    on = torch.rand(500, generator=g) < 0.7
    ref = search_clip_bounds(r, a, on.float(), BapoConfig())
    mask = on.to(mask_dtype) if mask_dtype in (torch.bool, torch.int64) else on.to(mask_dtype) * 0.5
    res = search_clip_bounds(r, a, mask, BapoConfig())
    assert res == ref
