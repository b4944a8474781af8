"""Policy loss: analytic gradients, the textbook PPO/dual-clip formula, and split invariance."""

from __future__ import annotations

import pytest
import torch

from megatron_bapo.algorithms import finalize_loss_metrics, policy_loss


def _batch(seed=0, b=6, t=11):
    g = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(b, t, generator=g) * 3
    logp = behavior + torch.randn(b, t, generator=g) * 0.6  # ratios spread across the bounds
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    adv[0] = 0.0
    mask = (torch.rand(b, t, generator=g) < 0.8).float()
    mask[-1] = 0.0  # an empty sequence
    return logp.double(), behavior.double(), adv.double(), mask.double()


def _textbook(logp, behavior, adv, mask, c_low, c_high, dual_clip):
    """PPO with dual clip as usually written (verl/OpenRLHF style), token-mean."""
    ratio = torch.exp(logp - behavior)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, c_low, c_high)
    clipped = torch.maximum(l1, l2)
    if dual_clip is not None:
        l3 = -adv * dual_clip
        clipped = torch.where(adv < 0, torch.minimum(clipped, l3), clipped)
    return (clipped * mask).sum() / mask.sum()


@pytest.mark.parametrize("dual_clip", [3.0, None, 1.3])
def test_value_matches_textbook_ppo_and_gradient_is_analytic(dual_clip):
    logp, behavior, adv, mask = _batch()
    c_low, c_high = 0.7, 1.3
    x = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, behavior, adv, mask, c_low, c_high, dual_clip=dual_clip)
    loss.backward()
    ref = _textbook(logp, behavior, adv, mask, c_low, c_high, dual_clip)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)

    # d loss / d logp_t = -A_t r_t / num_tokens for tokens inside the closed bounds, else 0.
    r = torch.exp(logp - behavior)
    inside = torch.where(adv > 0, r <= c_high, r >= c_low)
    if dual_clip is not None:
        inside &= ~((adv < 0) & (r > dual_clip))
    expected = torch.where(inside & (mask > 0), -adv * r, torch.zeros_like(r)) / mask.sum()
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-15)
    # The batch exercises every branch.
    assert metrics["num_clipped_pos"] > 0 and metrics["num_clipped_neg"] > 0
    if dual_clip == 1.3:
        assert metrics["num_dual_clipped"] > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_microbatch_and_dp_split_with_global_denominator_gives_the_same_gradient(agg):
    logp, behavior, adv, mask = _batch(seed=1, b=8)
    x = logp.clone().requires_grad_(True)
    full, _ = policy_loss(x, behavior, adv, mask, 0.8, 1.2, agg=agg)
    full.backward()

    # 2 simulated DP ranks x uneven micro-batches; each rank's grads are summed (the DP all-reduce).
    num_tokens = mask.sum().item()
    num_seqs = (mask.sum(-1) > 0).sum().item()
    y = logp.clone().requires_grad_(True)
    total = 0.0
    for rank_rows in (range(0, 5), range(5, 8)):
        rows = list(rank_rows)
        for mb in (rows[:1], rows[1:]):
            if not mb:
                continue
            lo, hi = mb[0], mb[-1] + 1
            loss, _ = policy_loss(
                y[lo:hi], behavior[lo:hi], adv[lo:hi], mask[lo:hi], 0.8, 1.2,
                agg=agg, num_global_tokens=num_tokens, num_global_seqs=num_seqs,
            )
            loss.backward()
            total += loss.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-12, atol=1e-15)


def test_local_mean_per_microbatch_would_differ():
    """Guards the test above: a per-micro-batch mean is not the global mean on this data."""
    logp, behavior, adv, mask = _batch(seed=1, b=8)
    full, _ = policy_loss(logp, behavior, adv, mask, 0.8, 1.2)
    a, _ = policy_loss(logp[:1], behavior[:1], adv[:1], mask[:1], 0.8, 1.2)
    b, _ = policy_loss(logp[1:], behavior[1:], adv[1:], mask[1:], 0.8, 1.2)
    assert abs((a + b).item() / 2 - full.item()) > 1e-6


def test_padding_with_garbage_logprobs_does_not_poison_gradients():
    logp, behavior, adv, mask = _batch()
    logp = logp.masked_fill(mask == 0, float("-inf"))
    behavior = behavior.masked_fill(mask == 0, float("nan"))
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, behavior, adv, mask, 0.8, 1.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def test_metrics_finalize_to_fractions():
    logp, behavior, adv, mask = _batch()
    _, m = policy_loss(logp, behavior, adv, mask, 0.8, 1.2)
    out = finalize_loss_metrics({k: v.item() for k, v in m.items()})
    assert 0 <= out["actor/clipfrac_pos"] <= 1 and 0 <= out["actor/clipfrac_neg"] <= 1
    assert out["actor/kl"] >= 0  # k3 estimator is non-negative
    r = torch.exp(logp - behavior)
    on = mask > 0
    assert out["actor/ratio_mean"] == pytest.approx(r[on].mean().item(), rel=1e-9)


def test_bad_arguments_name_the_problem():
    logp, behavior, adv, mask = _batch()
    with pytest.raises(ValueError, match="agg"):
        policy_loss(logp, behavior, adv, mask, 0.8, 1.2, agg="mean")
    with pytest.raises(ValueError, match="c_low"):
        policy_loss(logp, behavior, adv, mask, 1.2, 0.8)
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(logp[:1], behavior, adv, mask, 0.8, 1.2)


@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_extreme_but_finite_behavior_logprobs_give_finite_loss_and_gradient(dual_clip):
    """A behavior log-prob 1e4 below (or above) the current one: exp() of the raw log-ratio overflows
    to inf, and the clipped branch's gradient would be 0 * inf = NaN. The clamped log-ratio keeps
    the loss, its gradient, the metrics and the bound search finite."""
    from megatron_bapo.algorithms import BapoConfig, clamped_log_ratio, search_clip_bounds

    logp, behavior, adv, mask = _batch(seed=3)
    behavior = behavior.clone()
    behavior[1, 2] = logp[1, 2] - 1e4  # ratio e^10000: positive-advantage token, clipped
    behavior[2, 3] = logp[2, 3] + 1e4  # ratio e^-10000
    adv = adv.clone()
    adv[1], adv[2] = 1.0, -1.0
    mask = mask.clone()
    mask[1, 2] = mask[2, 3] = 1.0
    x = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, behavior, adv, mask, 0.8, 1.2, dual_clip=dual_clip)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    assert x.grad[1, 2] == 0  # clipped above c_high: no gradient, as without the overflow
    ratio = torch.exp(clamped_log_ratio(logp, behavior) * mask)
    result = search_clip_bounds(ratio, adv, mask, BapoConfig())  # raised on inf ratios before the clamp
    assert 0.0 <= result.rho <= 1.0
