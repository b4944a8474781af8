"""DPPO, CISPO and SAPO against literal references: values, gradients, masks and split invariance.

Each reference writes the paper's objective the way its authors' code does (verl's `dppo_tv`,
`dppo_kl`, `cispo`, `sapo`: `-A * sg(weight) * log pi` with the mask, or `-f(r) A`), in float64,
with its own token mean. The module under test writes the same gradient with a different value
(`sg(w) * A`, PPO's surrogate where nothing is clipped); gradients must agree to rounding, values
to their own literal formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_bapo.algorithms.cispo import CispoConfig, cispo_loss
from megatron_bapo.algorithms.dppo import DppoConfig, divergence, dppo_loss
from megatron_bapo.algorithms.policy_loss import finalize_loss_metrics, policy_loss
from megatron_bapo.algorithms.sapo import SapoConfig, sapo_loss


def _batch(seed=0, b=6, t=11, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(b, t, generator=g) * 3
    logp = (behavior + torch.randn(b, t, generator=g) * spread).clamp(max=-1e-3)  # a probability < 1
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    adv[0] = 0.0
    mask = (torch.rand(b, t, generator=g) < 0.8).double()
    mask[-1] = 0.0  # an empty sequence
    return logp.double(), behavior.double(), adv.double(), mask


def _mean(x, mask):
    return (x * mask).sum() / mask.sum()


def _ref_dppo(logp, mu_logp, adv, mask, kind, low, high, cap):
    """verl's compute_policy_loss_dppo_tv / _kl, transcribed (token-mean)."""
    ratio = torch.exp(logp - mu_logp)
    w = ratio if cap is None else ratio.clamp(max=cap)
    pi, mu = logp.exp(), mu_logp.exp()
    if kind == "tv":
        valid = torch.where(adv > 0, (pi - mu) <= high, (pi - mu) >= -low)
    else:
        kl = mu * (mu_logp - logp) + (1 - mu) * torch.log((1 - mu) / (1 - pi))
        valid = torch.where(adv > 0, (kl <= high) | (pi <= mu), (kl <= low) | (pi >= mu))
    grad_form = -adv * w.detach() * logp * valid.double()  # the paper's form: its gradient is the reference
    value = -adv * w * valid.double()  # the value we define: sg(w) A on passing tokens
    return _mean(grad_form, mask), _mean(value, mask), valid


@pytest.mark.parametrize("kind, low, high, cap", [("tv", 0.15, 0.15, None), ("tv", 0.05, 0.3, 2.0),
                                                  ("kl", 0.05, 0.05, None), ("kl", 0.02, 0.2, 5.0)])
def test_dppo_matches_the_papers_objective(kind, low, high, cap):
    logp, mu, adv, mask = _batch(b=12, spread=1.0)
    cfg = DppoConfig(divergence=kind, delta_low=low, delta_high=high, ratio_cap=cap)
    x = logp.clone().requires_grad_(True)
    loss, stats = dppo_loss(x, mu, adv, mask, cfg)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    ref_grad_form, ref_value, valid = _ref_dppo(y, mu, adv, mask, kind, low, high, cap)
    ref_grad_form.backward()
    assert loss.item() == pytest.approx(ref_value.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    on = mask > 0
    assert stats["num_clipped_pos"] == (on & (adv > 0) & ~valid).sum()
    assert stats["num_clipped_neg"] == (on & (adv < 0) & ~valid).sum()
    assert stats["num_clipped_pos"] > 0 and stats["num_clipped_neg"] > 0  # both sides of the region act
    if cap is not None:
        assert (torch.exp(logp - mu)[on & valid & (adv != 0)] > cap).any()  # the cap acts too


def test_dppo_divergence_is_signed_and_matches_the_binary_formulas():
    logp = torch.log(torch.tensor([0.5, 0.2, 0.9, 0.3], dtype=torch.float64))
    mu = torch.log(torch.tensor([0.3, 0.4, 0.9, 0.3], dtype=torch.float64))
    torch.testing.assert_close(divergence(logp, mu, "tv"), torch.tensor([0.2, -0.2, 0.0, 0.0], dtype=torch.float64))
    p, q = 0.5, 0.3
    kl = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    got = divergence(logp, mu, "kl")
    assert got[0].item() == pytest.approx(kl, rel=1e-12) and got[1].item() < 0 and got[2].item() == 0.0
    # A token the policy is certain of (p = 1) stays finite.
    assert torch.isfinite(divergence(torch.zeros(1), torch.log(torch.tensor([0.5])), "kl")).all()


@pytest.mark.parametrize("c_low, c_high", [(0.0, 5.0), (0.8, 1.2), (0.5, 1.28)])
def test_cispo_matches_the_papers_objective(c_low, c_high):
    logp, mu, adv, mask = _batch(seed=2, spread=0.6)
    x = logp.clone().requires_grad_(True)
    loss, stats = cispo_loss(x, mu, adv, mask, CispoConfig(c_low=c_low, c_high=c_high))
    loss.backward()
    y = logp.clone().requires_grad_(True)
    ratio = torch.exp(y - mu)
    weight = torch.clamp(ratio, c_low, c_high).detach()
    _mean(-weight * adv * y, mask).backward()  # MiniMax-M1 eq. 4, as verl writes it
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    assert loss.item() == pytest.approx(_mean(-weight * adv, mask).item(), rel=1e-12, abs=1e-15)
    on = mask > 0
    clipped = on & ((ratio > c_high) | (ratio < c_low)) & (adv != 0)
    assert stats["num_clipped_pos"] + stats["num_clipped_neg"] == clipped.sum()
    if c_high < 2:
        assert stats["num_clipped_pos"] > 0 and stats["num_clipped_neg"] > 0
    # Every token passes a gradient, clipped or not: the point of CISPO.
    assert (x.grad[on & (adv != 0)] != 0).all()


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_matches_the_papers_objective(tau_pos, tau_neg):
    logp, mu, adv, mask = _batch(seed=3, spread=0.5)
    x = logp.clone().requires_grad_(True)
    loss, stats = sapo_loss(x, mu, adv, mask, SapoConfig(tau_pos=tau_pos, tau_neg=tau_neg))
    loss.backward()
    y = logp.clone().requires_grad_(True)
    ratio = torch.exp(y - mu)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    ref = _mean(-(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv, mask)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    # On-policy (r = 1) the gate's slope is 1: SAPO's gradient is the policy gradient there.
    z = mu.clone().requires_grad_(True)
    sapo_loss(z, mu, adv, mask, SapoConfig(tau_pos=tau_pos, tau_neg=tau_neg))[0].backward()
    w = mu.clone().requires_grad_(True)
    policy_loss(w, mu, adv, mask, 0.8, 1.2)[0].backward()
    torch.testing.assert_close(z.grad, w.grad, rtol=1e-12, atol=1e-15)
    assert stats["num_clipped_pos"] == 0 and stats["num_clipped_neg"] == 0


LOSSES = {
    "dppo": lambda *a, **k: dppo_loss(*a, DppoConfig(delta_low=0.1, delta_high=0.2), **k),
    "dppo_kl": lambda *a, **k: dppo_loss(*a, DppoConfig(divergence="kl"), **k),
    "cispo": lambda *a, **k: cispo_loss(*a, CispoConfig(c_high=1.3), **k),
    "sapo": lambda *a, **k: sapo_loss(*a, SapoConfig(), **k),
}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_microbatch_and_dp_split_with_global_denominator_gives_the_same_gradient(name, agg):
    fn = LOSSES[name]
    logp, mu, adv, mask = _batch(seed=1, b=8)
    x = logp.clone().requires_grad_(True)
    full, _ = fn(x, mu, adv, mask, agg=agg)
    full.backward()
    num_tokens, num_seqs = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    y = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0], [1, 2, 3, 4], [5, 6, 7]):  # uneven micro-batches over two "ranks"
        lo, hi = rows[0], rows[-1] + 1
        loss, _ = fn(y[lo:hi], mu[lo:hi], adv[lo:hi], mask[lo:hi], agg=agg, num_global_tokens=num_tokens,
                     num_global_seqs=num_seqs)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_loss_mask_is_exact_and_padding_garbage_is_harmless(name):
    """A masked token (a tool's output, padding) changes nothing, whatever its log-probs hold."""
    fn = LOSSES[name]
    logp, mu, adv, mask = _batch(seed=4)
    x = logp.clone().requires_grad_(True)
    loss, stats = fn(x, mu, adv, mask)
    loss.backward()
    garbage_lp = logp.masked_fill(mask == 0, float("-inf"))
    garbage_mu = mu.masked_fill(mask == 0, float("nan"))
    y = garbage_lp.clone().requires_grad_(True)
    loss2, stats2 = fn(y, garbage_mu, adv * 1.0, mask)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    assert torch.isfinite(y.grad).all() and (y.grad[mask == 0] == 0).all()
    torch.testing.assert_close(y.grad[mask > 0], x.grad[mask > 0], rtol=1e-12, atol=1e-15)
    assert all(torch.isfinite(v) for v in stats2.values())
    assert stats2["num_tokens"] == mask.sum()
    out = finalize_loss_metrics({k: v.item() for k, v in stats2.items()})
    assert 0 <= out["actor/clipfrac"] <= 1


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_importance_weights_scale_each_tokens_gradient(name):
    """`token_weights` (aggregation weights x TIS/MIS corrections) multiply a token's term exactly."""
    fn = LOSSES[name]
    logp, mu, adv, mask = _batch(seed=5)
    g = torch.Generator().manual_seed(9)
    corr = torch.rand(logp.shape, generator=g, dtype=torch.float64) * 2
    x = logp.clone().requires_grad_(True)
    fn(x, mu, adv, mask, token_weights=mask * corr, denominator=7.0)[0].backward()
    y = logp.clone().requires_grad_(True)
    fn(y, mu, adv, mask, token_weights=mask, denominator=7.0)[0].backward()
    torch.testing.assert_close(x.grad, y.grad * corr, rtol=1e-12, atol=1e-15)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="DppoConfig.divergence"):
        DppoConfig(divergence="js")
    with pytest.raises(ValueError, match="DppoConfig.delta_high"):
        DppoConfig(delta_high=1.5)  # TV is at most 1
    with pytest.raises(ValueError, match="DppoConfig.low_min"):
        DppoConfig(delta_low=0.1, low_min=0.2)
    with pytest.raises(ValueError, match="ratio_cap"):
        DppoConfig(ratio_cap=0.5)
    with pytest.raises(ValueError, match="c_low"):
        CispoConfig(c_low=1.2)
    with pytest.raises(ValueError, match="tau_neg"):
        SapoConfig(tau_neg=0.0)
    grid = DppoConfig().search_grid()
    assert grid == pytest.approx((0.6, 0.01, 0.05, 0.005), rel=1e-12)
    assert DppoConfig(divergence="kl").lower == 0.05 and DppoConfig(delta_low=0.1).upper == 0.1
