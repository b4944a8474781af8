"""CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1, arXiv 2506.13585, eq. 4-5).

PPO's clip drops a token's gradient once its ratio leaves the bounds, so tokens whose probability
moved most (often the rare, "reflective" ones) stop learning. CISPO keeps every token's gradient
and clips only the importance weight that scales it:

    J = sum_t sg(clip(r_t, c_low, c_high)) * A_t * log pi(y_t) / D      r_t = pi / pi_ref

`c_low = 1 - eps_low^IS`, `c_high = 1 + eps_high^IS`. MiniMax-M1 sets no lower bound (a large
eps_low) and tunes only the upper one, without printing its value; our defaults, `c_low = 0` and
`c_high = 5`, are ScaleRL's (arXiv 2510.13786), as SkyRL ships them. Written here as

    term_t = sg(clip(r_t)) * A_t                 with d term_t / d logp_t = clip(r_t) A_t

(the same gradient as `sg(clip(r)) A log pi`; the value is PPO's surrogate `r A` where r is inside
the bounds). No token is masked and there is no dual clip. `num_clipped_pos` / `num_clipped_neg`
count tokens (by advantage sign) whose weight was clipped, at either bound. Aggregation, masks,
denominators and the other metrics are those of `policy_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bapo.algorithms.policy_loss import aggregate_loss, loss_inputs, ratio_metrics


@dataclass(frozen=True)
class CispoConfig:
    """CISPO's importance-weight bounds (`actor.cispo`).

    With an adaptive BAPO preset the upper bound is searched instead, on BAPO's own `c_high` grid
    (`actor.bapo.high_start` .. `high_max`), and `c_high` here is not used (docs/bapo.md).
    """

    c_low: float = 0.0
    """Lower bound of the weight (1 - eps_low^IS); 0 = none, as MiniMax-M1 runs it."""
    c_high: float = 5.0
    """Upper bound of the weight (1 + eps_high^IS); ScaleRL's 5."""

    def __post_init__(self) -> None:
        for name in ("c_low", "c_high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"CispoConfig.{name} must be a finite number, got {value!r}")
        if not 0.0 <= self.c_low < 1.0 < self.c_high:
            raise ValueError(f"CispoConfig needs 0 <= c_low < 1 < c_high (an on-policy weight, 1, is inside), got "
                             f"c_low={self.c_low}, c_high={self.c_high}")


def cispo_weight(ratio: torch.Tensor, c_low: float, c_high: float) -> torch.Tensor:
    """clip(r, c_low, c_high): the weight of every token's gradient."""
    return ratio.clamp(min=c_low, max=c_high)


def cispo_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: CispoConfig,
    *,
    c_high: Optional[float] = None,
    agg: str = "token-mean",
    num_global_tokens: Optional[float] = None,
    num_global_seqs: Optional[float] = None,
    token_weights: Optional[torch.Tensor] = None,
    denominator: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO loss and its reduction-ready statistics (the contract of `policy_loss`).

    Shapes: `[B, T]` (any shape for token-mean), all equal. `c_high` overrides the config's upper
    bound (the balanced search's choice for this step). Returns (scalar loss, float64 sums).
    """
    high = config.c_high if c_high is None else float(c_high)
    if not high > config.c_low:
        raise ValueError(f"cispo_loss: c_high ({high}) must be > c_low ({config.c_low})")
    t = loss_inputs("cispo_loss", logprobs, ref_logprobs, advantages, mask, agg, token_weights, denominator)
    w = cispo_weight(t.ratio, config.c_low, high).detach()
    clipped = t.keep & ((t.ratio > high) | (t.ratio < config.c_low))
    unit = torch.exp(t.log_ratio - t.log_ratio.detach())  # value 1, derivative 1 in logp
    token_loss = -(w * unit * t.adv) * t.maskf
    loss = aggregate_loss(token_loss, mask, agg, num_global_tokens, num_global_seqs, token_weights, denominator)
    return loss, ratio_metrics(t, token_loss, num_clipped_pos=clipped & t.pos, num_clipped_neg=clipped & t.neg)
