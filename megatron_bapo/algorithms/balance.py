"""BAPO's balance for DPPO and CISPO, and the positive share of SAPO: one pass, one collective.

BAPO (design section 4) moves PPO's clip bounds until the positive tokens carry a share `rho0` of
the gradient. The same idea applies to any loss whose trust region has a side for positive and a
side for negative advantages. "Contribution" is, per loss, the gradient mass of a token: the size
of `d term_t / d logp_t` with the step's parameters, times `w_t` (1, or the rollout probability
with `actor.bapo.weight: rollout_prob`) and the token's loss weight `a_t c_t` (`token_weights`:
its aggregation weight under `actor.loss_agg` times its importance correction, `loss_token_weights`),
so P and N are the positive and negative mass of the applied gradient (times its denominator D):

    DPPO:  |A| * min(r, ratio_cap)        if the token passes the trust region, else 0
           P(dh) = sum_{A>0, d <= dh} ...,  N(dl) = sum_{A<0, d >= -dl} ...
           raising delta_high admits positives, lowering delta_low masks negatives: the balance
           never decreases along the path (as BAPO's `gradient` contribution).
    CISPO: |A| * clip(r, c_low, c_high)   every token passes; only the weight's cap moves:
           P(ch) = sum_{A>0} ...,  N(ch) = sum_{A<0} ...
           raising c_high lets positives whose probability rose (r > c_high) push harder; it can
           raise N too (negatives above the cap), so the balance is not monotone along the path and
           the search takes the first grid point that meets rho0.
    SAPO:  |A| * 4 s (1 - s) r            measured only (`measure_sapo`): SAPO has no bounds to move.

The search spaces: DPPO's `delta_high` rises on `DppoConfig.search_grid()` and `delta_low` falls
on it, walked in `actor.bapo.order` exactly as BAPO's bounds (paper: raise delta_high while it can,
then lower delta_low; verl: lower delta_low first). CISPO's `c_high` rises on BAPO's own upper grid
(`actor.bapo.high_start` .. `high_max` by `high_step`, clamped to `high_max` in the verl order), from
the first point until the balance is met; its floor `c_low` stays. A fixed preset (`grpo`) gives
each grid one point: the configured parameters, whose balance is then only measured.

Exactness, and the one pass: DPPO's P and N are `bound_search.contribution_vectors` with the
divergence `d` as the coordinate (positives binned against delta_high, negatives against
`-delta_low`) and the importance weight as the per-token value; CISPO's are its `surrogate` sums
`sum m min(x, c)` with the coordinate `x = max(r, c_low)` for positives and `-max(r, c_low)` for
negatives against the negated, reversed grid, where `max(-x, -c) = -min(x, c)`. Both are one pass
over the tokens and one float64 all-reduce over `group`; every rank walks the same sums.

Tie convention (shared with the losses): a DPPO positive passes iff `d <= delta_high`, a negative
iff `d >= -delta_low`, compared in float64 (the dtype of `dppo.divergence`); CISPO's weight is
continuous in r, so ties do not matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bapo.algorithms.bound_search import (
    BoundSearchResult,
    balance_metric,
    bound_grid,
    contribution_vectors,
    reduction_device,
    walk_path,
)
from megatron_bapo.algorithms.cispo import CispoConfig
from megatron_bapo.algorithms.config import BapoConfig
from megatron_bapo.algorithms.dppo import DppoConfig, divergence, importance_weight
from megatron_bapo.algorithms.policy_loss import clamped_log_ratio
from megatron_bapo.algorithms.sapo import SapoConfig, sapo_gate_slope


@dataclass(frozen=True)
class GridSpec:
    """What `contribution_vectors` reads from a config, for grids that are not BAPO's ratio bounds."""

    contribution: str
    weight: str
    high_step: float
    low_step: float
    dual_clip: Optional[float] = None


def _reduce(vec: torch.Tensor, group) -> list[float]:
    """One float64 all-reduce over `group` (None: nothing to reduce); the host copy."""
    if group is not None:
        vec = vec.to(reduction_device(group, vec.device))
        torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.SUM, group=group)
    return vec.cpu().tolist()


class NonfiniteTokens(ValueError):
    """Loss tokens with NaN/inf inputs across the reduction group (raised on every rank of it alike)."""

    def __init__(self, message: str, count: int) -> None:
        super().__init__(message)
        self.count = count


def _check_counts(extras: list[float], who: str) -> tuple[int, int, int]:
    num_nonfinite, num_tokens, num_pos, num_neg = (int(x) for x in extras)
    if num_nonfinite:
        raise NonfiniteTokens(f"{who}: {num_nonfinite} loss tokens have NaN/inf log-probs, advantages or weights "
                         "(across the reduction group); check the log-probs and rewards feeding this step",
                              num_nonfinite)
    return num_tokens, num_pos, num_neg


def dppo_grids(dppo: DppoConfig, bapo: BapoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta_high grid, ascending; `-delta_low` grid, ascending) of the search; one point each
    when `bapo` is not adaptive."""
    if not bapo.is_adaptive:
        return (torch.tensor([dppo.upper], dtype=torch.float64), torch.tensor([-dppo.lower], dtype=torch.float64))
    high_max, high_step, low_min, low_step = dppo.search_grid()
    clamp = bapo.order == "verl"
    return (bound_grid(dppo.upper, high_max, high_step, clamp_to_stop=clamp),
            bound_grid(-dppo.lower, -low_min, low_step, clamp_to_stop=clamp))


def search_dppo(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                dppo: DppoConfig, bapo: BapoConfig, *, rollout_logprobs: Optional[torch.Tensor] = None,
                token_weights: Optional[torch.Tensor] = None, group=None) -> BoundSearchResult:
    """DPPO's thresholds for one optimizer step: `c_low` = delta_low, `c_high` = delta_high.

    Shapes: any, all equal (`logprobs` current, `ref_logprobs` the trust region's reference,
    `rollout_logprobs` the behavior log-probs for `weight: rollout_prob`, `token_weights` the
    loss's own weights, `loss_token_weights`). Masked tokens are ignored. One pass, one all-reduce over `group`
    (None: this process holds the whole mini-batch); the result is identical on every rank.
    """
    high, low = dppo_grids(dppo, bapo)
    keep = mask > 0
    coord = torch.where(keep, divergence(logprobs, ref_logprobs, dppo.divergence), 0.0)
    # The loss's importance weight, computed as the loss computes it (in the log-probs' dtype).
    ratio = torch.exp(torch.where(keep, clamped_log_ratio(logprobs.detach(), ref_logprobs), 0.0))
    _, high_step, _, low_step = dppo.search_grid()
    spec = GridSpec("gradient", bapo.weight, high_step, low_step)
    # The coordinate is float64 (binned exactly as the loss compares it); the advantages follow it.
    vec = contribution_vectors(coord, advantages.to(torch.float64), mask, spec, high, low, rollout_logprobs,
                               token_weights=token_weights, values=importance_weight(ratio, dppo.ratio_cap))
    sums = _reduce(vec, group)
    num_k, num_j = high.numel(), low.numel()
    p_vec, n_vec = sums[:num_k], sums[num_k:num_k + num_j]
    num_tokens, num_pos, num_neg = _check_counts(sums[num_k + num_j:], "search_dppo")
    k, j, steps = walk_path(p_vec, n_vec, bapo)
    return BoundSearchResult(
        c_low=-float(low[j]), c_high=float(high[k]), rho=balance_metric(p_vec[k], n_vec[j], bapo.metric),
        rho_initial=balance_metric(p_vec[0], n_vec[0], bapo.metric), num_steps=steps, pos_contribution=p_vec[k],
        neg_contribution=n_vec[j], num_tokens=num_tokens, num_pos_tokens=num_pos, num_neg_tokens=num_neg)


def cispo_grid(cispo: CispoConfig, bapo: BapoConfig) -> torch.Tensor:
    """The c_high grid of the search (ascending): BAPO's upper grid, or the fixed cap."""
    if not bapo.is_adaptive:
        return torch.tensor([cispo.c_high], dtype=torch.float64)
    grid = bound_grid(bapo.high_start, bapo.high_max, bapo.high_step, clamp_to_stop=bapo.order == "verl")
    if not cispo.c_low < float(grid[0]):
        raise ValueError(f"CISPO's floor c_low={cispo.c_low} must lie below the searched cap's start "
                         f"actor.bapo.high_start={bapo.high_start}")
    return grid


def search_cispo(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 cispo: CispoConfig, bapo: BapoConfig, *, rollout_logprobs: Optional[torch.Tensor] = None,
                 token_weights: Optional[torch.Tensor] = None, group=None) -> BoundSearchResult:
    """CISPO's cap for one optimizer step: `c_low` = the fixed floor, `c_high` = the searched cap.
    Contract as `search_dppo`."""
    high = cispo_grid(cispo, bapo)
    keep = mask > 0
    ratio = torch.exp(torch.where(keep, clamped_log_ratio(logprobs.detach(), ref_logprobs), 0.0))
    floored = ratio.clamp(min=cispo.c_low)
    coord = torch.where(advantages < 0, -floored, floored)
    step = bapo.high_step if high.numel() > 1 else 1.0
    spec = GridSpec("surrogate", bapo.weight, step, step)
    vec = contribution_vectors(coord, advantages, mask, spec, high, -high.flip(0), rollout_logprobs,
                               token_weights=token_weights)
    sums = _reduce(vec, group)
    num_k = high.numel()
    p_vec = sums[:num_k]
    n_vec = [-x for x in reversed(sums[num_k:2 * num_k])]  # sum m min(x, c_k) = -sum m max(-x, -c_k)
    num_tokens, num_pos, num_neg = _check_counts(sums[2 * num_k:], "search_cispo")
    k = 0
    while balance_metric(p_vec[k], n_vec[k], bapo.metric) < bapo.rho0 and k + 1 < num_k:
        k += 1
    return BoundSearchResult(
        c_low=float(cispo.c_low), c_high=float(high[k]), rho=balance_metric(p_vec[k], n_vec[k], bapo.metric),
        rho_initial=balance_metric(p_vec[0], n_vec[0], bapo.metric), num_steps=k, pos_contribution=p_vec[k],
        neg_contribution=n_vec[k], num_tokens=num_tokens, num_pos_tokens=num_pos, num_neg_tokens=num_neg)


def measure_sapo(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 sapo: SapoConfig, bapo: BapoConfig, *, rollout_logprobs: Optional[torch.Tensor] = None,
                 token_weights: Optional[torch.Tensor] = None, group=None) -> BoundSearchResult:
    """SAPO's positive share (nothing is searched: `num_steps` 0, `c_low` / `c_high` NaN).
    Contract as `search_dppo`."""
    keep = mask > 0
    lr = torch.where(keep, clamped_log_ratio(logprobs.detach(), ref_logprobs), 0.0).to(torch.float64)
    adv = torch.where(keep, advantages.detach().to(torch.float64), 0.0)
    finite = torch.isfinite(lr) & torch.isfinite(adv)
    mass = adv.abs().nan_to_num(0.0, 0.0, 0.0)
    tau = torch.where(adv > 0, torch.full_like(adv, sapo.tau_pos), torch.full_like(adv, sapo.tau_neg))
    mass = mass * sapo_gate_slope(lr.nan_to_num(0.0, 0.0, 0.0).exp(), tau)
    for extra in ((rollout_logprobs if bapo.weight == "rollout_prob" else None), token_weights):
        if extra is not None:
            x = torch.where(keep, extra.detach().to(torch.float64), 0.0)
            finite &= torch.isfinite(x)
            mass = mass * (x.nan_to_num(0.0, 0.0, 0.0).exp() if extra is rollout_logprobs else x.nan_to_num(0.0))
    mass = torch.where(keep & finite, mass, 0.0)
    on = keep.to(torch.float64)
    vec = torch.stack([mass[adv > 0].sum(), mass[adv < 0].sum(), ((~finite) & keep).sum().to(torch.float64),
                       on.sum(), ((adv > 0) & keep).sum().to(torch.float64), ((adv < 0) & keep).sum().to(torch.float64)])
    pos, neg, *extras = _reduce(vec, group)
    num_tokens, num_pos, num_neg = _check_counts(extras, "measure_sapo")
    rho = balance_metric(pos, neg, bapo.metric)
    return BoundSearchResult(c_low=math.nan, c_high=math.nan, rho=rho, rho_initial=rho, num_steps=0,
                             pos_contribution=pos, neg_contribution=neg, num_tokens=num_tokens, num_pos_tokens=num_pos,
                             num_neg_tokens=num_neg)
