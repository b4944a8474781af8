"""DPPO: a trust region from a divergence mask instead of ratio clipping (Qi et al. 2026, arXiv 2602.04879).

PPO's clip decides from the sampled token's ratio `r = pi / mu`, a one-sample estimate of how far
the policy moved: a rare token whose probability goes from 1e-4 to 1e-3 is clipped (r = 10), a
common one going from 0.9 to 0.5 is not (r = 0.56). DPPO masks a token by a divergence between the
two next-token distributions instead, approximated from the sampled token alone ("Binary": the
sampled token against everything else), and keeps the one-sided structure of PPO's clip:

    A > 0: the token passes iff the policy did not move towards it by more than delta_high
    A < 0: the token passes iff the policy did not move away from it by more than delta_low

with `pi = exp(logp)` the current and `mu = exp(logp_ref)` the reference probability of the token
(the ratio's reference: the behavior policy with `actor.old_logprobs: rollout`, which the paper
finds essential, or the recomputed old policy), and the divergence measured as

    tv: d = pi - mu                                   (Binary-TV; paper default delta = 0.15)
    kl: d = sign(pi - mu) * [mu log(mu / pi) + (1 - mu) log((1 - mu) / (1 - pi))]
                                                      (Binary-KL, KL(mu || pi); paper default 0.05)

so a positive token passes iff `d <= delta_high` and a negative one iff `d >= -delta_low` (ties
pass, as in `policy_loss`). A passing token contributes the importance-weighted policy gradient,
with the weight `w = r` (or `min(r, ratio_cap)`) held constant:

    term_t = sg(w_t) * A_t * [passes]   with d term_t / d logp_t = w_t A_t [passes]

which is the paper's (and verl's `dppo_tv` / `dppo_kl`) `-A * sg(w) * log pi * mask` up to a
constant: the same gradient, and a loss value equal to PPO's surrogate `r A` on passing tokens.
The divergence is computed in float64 by `divergence`, which the balanced search (`balance.py`)
calls on the same log-probs, so both compare the same numbers with the same thresholds.

Aggregation, masks, denominators and metrics are those of `policy_loss` (`loss_inputs`,
`aggregate_loss`, `ratio_metrics`); `num_clipped_pos` / `num_clipped_neg` count the tokens the
trust region masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bapo.algorithms.policy_loss import aggregate_loss, loss_inputs, ratio_metrics

DIVERGENCES = ("tv", "kl")
PAPER_DELTA = {"tv": 0.15, "kl": 0.05}
"""The paper's (and its authors' verl recipe's) threshold per divergence, used on both sides."""
_PROB_CLAMP = 1.0 - 1e-12
"""Probabilities are held below 1 in the binary KL's `log(1 - p)` (float64)."""


@dataclass(frozen=True)
class DppoConfig:
    """DPPO's trust region (`actor.dppo`): the divergence, its thresholds, the search grid of the balance.

    Without an adaptive BAPO preset the thresholds are fixed at `delta_low` / `delta_high`. With one
    (`bapo_preset: bapo`, ...), BAPO's balance moves them per optimizer step on the grid below:
    `delta_high` up to `high_max`, `delta_low` down to `low_min` (docs/bapo.md, "BAPO's balance for
    DPPO and CISPO"). None: derived from the threshold (the TV values are given).
    """

    divergence: str = "tv"
    """"tv" (Binary-TV, the paper's main variant) or "kl" (Binary-KL)."""
    delta_low: Optional[float] = None
    """Threshold for negative advantages (how far the policy may move away from the token); None:
    the paper's default for the divergence (tv 0.15, kl 0.05)."""
    delta_high: Optional[float] = None
    """Threshold for positive advantages (how far it may move towards the token); None: as delta_low."""
    ratio_cap: Optional[float] = None
    """Truncate the importance weight at this value (min(r, cap)); None: no truncation, as the
    authors' recipe runs it (the paper reports that truncation biases against rare tokens)."""
    high_max: Optional[float] = None
    """Balance: the largest delta_high the search may reach; None: 4 x delta_high (at most 1 for tv: 0.6)."""
    high_step: Optional[float] = None
    """Balance: grid step of delta_high; None: 45 steps up to high_max (0.01 for tv)."""
    low_min: Optional[float] = None
    """Balance: the smallest delta_low the search may reach; None: delta_low / 3 (0.05 for tv)."""
    low_step: Optional[float] = None
    """Balance: grid step of delta_low; None: 20 steps down to low_min (0.005 for tv)."""

    def __post_init__(self) -> None:
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"DppoConfig.divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        for name in ("delta_low", "delta_high", "ratio_cap", "high_max", "high_step", "low_min", "low_step"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"DppoConfig.{name} must be a finite number > 0 or null, got {value!r}")
        if self.ratio_cap is not None and self.ratio_cap <= 1.0:
            raise ValueError(f"DppoConfig.ratio_cap must be > 1 (a truncation of the importance weight) or null, "
                             f"got {self.ratio_cap}")
        if self.high_max is not None and self.high_max < self.upper:
            raise ValueError(f"DppoConfig.high_max ({self.high_max}) must be >= delta_high ({self.upper}): the "
                             f"balance only raises delta_high")
        if self.low_min is not None and self.low_min > self.lower:
            raise ValueError(f"DppoConfig.low_min ({self.low_min}) must be <= delta_low ({self.lower}): the "
                             f"balance only lowers delta_low")
        if self.divergence == "tv":  # d = pi - mu lies in [-1, 1]: a threshold past 1 masks nothing
            for name, value in (("delta_low", self.lower), ("delta_high", self.upper), ("high_max", self.high_max)):
                if value is not None and value > 1.0:
                    raise ValueError(f"DppoConfig.{name}={value}: a TV divergence lies in [-1, 1], so a threshold "
                                     f"above 1 masks nothing; use a value in (0, 1]")
        high_max, high_step, low_min, low_step = self.search_grid()
        num_high, num_low = (high_max - self.upper) / high_step, (self.lower - low_min) / low_step
        if num_high > 10_000 or num_low > 10_000:
            raise ValueError(f"DppoConfig's balance grid is too fine: (high_max - delta_high) / high_step = {num_high:.0f} "
                             f"and (delta_low - low_min) / low_step = {num_low:.0f} must each be <= 10000; raise "
                             f"high_step / low_step")

    @property
    def lower(self) -> float:
        """delta_low as used (the paper's default when unset)."""
        return float(self.delta_low if self.delta_low is not None else PAPER_DELTA[self.divergence])

    @property
    def upper(self) -> float:
        """delta_high as used (delta_low's value when unset)."""
        return float(self.delta_high if self.delta_high is not None else self.lower)

    def search_grid(self) -> tuple[float, float, float, float]:
        """(delta_high max, its step, delta_low min, its step) of the balance search."""
        cap = 1.0 if self.divergence == "tv" else math.inf
        high_max = float(self.high_max if self.high_max is not None else min(4 * self.upper, max(cap, self.upper)))
        low_min = float(self.low_min if self.low_min is not None else self.lower / 3)
        high_step = self.high_step or ((high_max - self.upper) / 45 if high_max > self.upper else self.upper / 15)
        low_step = self.low_step or ((self.lower - low_min) / 20 if low_min < self.lower else self.lower / 30)
        return high_max, float(high_step), low_min, float(low_step)


def divergence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """The signed binary divergence `d` of every token (float64, the inputs' shape; module docstring).

    Positive where the policy moved towards the token (pi > mu). Finite for any finite inputs;
    callers mask padding themselves (its values are meaningless)."""
    lp = logprobs.detach().to(torch.float64)
    ref = ref_logprobs.detach().to(torch.float64)
    pi, mu = lp.exp(), ref.exp()
    if kind == "tv":
        return pi - mu
    if kind != "kl":
        raise ValueError(f"divergence: kind must be one of {DIVERGENCES}, got {kind!r}")
    pi_c, mu_c = pi.clamp(max=_PROB_CLAMP), mu.clamp(max=_PROB_CLAMP)
    kl = mu * (ref - lp) + (1.0 - mu) * (torch.log1p(-mu_c) - torch.log1p(-pi_c))
    return torch.sign(pi - mu) * kl.clamp(min=0.0)


def importance_weight(ratio: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """The constant weight `w` of a passing token: r, or min(r, cap)."""
    return ratio if cap is None else ratio.clamp(max=cap)


def dppo_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: DppoConfig,
    *,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    agg: str = "token-mean",
    num_global_tokens: Optional[float] = None,
    num_global_seqs: Optional[float] = None,
    token_weights: Optional[torch.Tensor] = None,
    denominator: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO loss and its reduction-ready statistics (the contract of `policy_loss`).

    Shapes: `[B, T]` (any shape for token-mean), all equal; `ref_logprobs` is the ratio's and the
    trust region's reference. `delta_low` / `delta_high` override the config's thresholds (the
    balanced search's choice for this step). Masked tokens count nowhere; the denominator is the
    global one passed in (`token_weights` / `denominator`, or `num_global_*`), as in `policy_loss`.
    Returns (scalar loss, float64 sums: `num_clipped_pos` / `num_clipped_neg` = tokens masked by the
    trust region).
    """
    low = config.lower if delta_low is None else float(delta_low)
    high = config.upper if delta_high is None else float(delta_high)
    if not (low > 0 and high > 0):
        raise ValueError(f"dppo_loss: thresholds must be > 0, got delta_low={low}, delta_high={high}")
    t = loss_inputs("dppo_loss", logprobs, ref_logprobs, advantages, mask, agg, token_weights, denominator)
    d = torch.where(t.keep, divergence(logprobs, ref_logprobs, config.divergence), 0.0)
    masked_pos = t.pos & (d > high)
    masked_neg = t.neg & (d < -low)
    passes = t.keep & ~masked_pos & ~masked_neg
    w = importance_weight(t.ratio, config.ratio_cap).detach()
    # Value w * A, gradient w * A * d(logp): exp(x - sg(x)) is 1 with derivative 1.
    unit = torch.exp(t.log_ratio - t.log_ratio.detach())
    term = torch.where(passes, w * unit * t.adv, torch.zeros_like(t.adv))
    token_loss = -term * t.maskf
    loss = aggregate_loss(token_loss, mask, agg, num_global_tokens, num_global_seqs, token_weights, denominator)
    return loss, ratio_metrics(t, token_loss, num_clipped_pos=masked_pos, num_clipped_neg=masked_neg)
