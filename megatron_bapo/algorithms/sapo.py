"""SAPO: soft, sign-dependent gates instead of a hard clip (Gao et al. 2025, arXiv 2511.20347).

The hard clip of PPO switches a token's gradient off at the bounds. SAPO replaces the surrogate
`r A` by `f_tau(r) A` with a smooth gate

    f_tau(r) = (4 / tau) * sigmoid(tau * (r - 1)),   tau = tau_pos if A > 0 else tau_neg

whose slope is 1 at r = 1 (on-policy, SAPO's gradient equals the policy gradient) and decays
smoothly as r moves away; `d f / d logp = 4 s (1 - s) r` with `s = sigmoid(tau (r - 1))`. A larger
temperature decays faster: the paper uses tau_neg > tau_pos (1.05 and 1.0, its section 5.1),
because negative updates spread over the whole vocabulary and destabilise more.

The paper averages per sequence (`1/|y_i|`, `actor.loss_agg: seq-mean-token-mean`); here the
aggregation is the actor's `loss_agg`, like every loss. No token is masked: `num_clipped_*` are 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bapo.algorithms.policy_loss import aggregate_loss, loss_inputs, ratio_metrics


@dataclass(frozen=True)
class SapoConfig:
    """SAPO's gate temperatures (`actor.sapo`), the paper's defaults."""

    tau_pos: float = 1.0
    """Temperature of the gate for positive advantages."""
    tau_neg: float = 1.05
    """Temperature of the gate for negative (and zero) advantages."""

    def __post_init__(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"SapoConfig.{name} must be a finite number > 0 (e.g. 1.0), got {value!r}")


def sapo_gate_slope(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """`|d f_tau(r) / d logp| = 4 s (1 - s) r`: the weight SAPO gives a token's gradient."""
    s = torch.sigmoid(tau * (ratio - 1.0))
    return 4.0 * s * (1.0 - s) * ratio


def sapo_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: SapoConfig,
    *,
    agg: str = "token-mean",
    num_global_tokens: Optional[float] = None,
    num_global_seqs: Optional[float] = None,
    token_weights: Optional[torch.Tensor] = None,
    denominator: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO loss `-f_tau(r) A` and its reduction-ready statistics (the contract of `policy_loss`).

    Shapes: `[B, T]` (any shape for token-mean), all equal. Returns (scalar loss, float64 sums).
    """
    t = loss_inputs("sapo_loss", logprobs, ref_logprobs, advantages, mask, agg, token_weights, denominator)
    tau = torch.where(t.adv > 0, torch.full_like(t.adv, config.tau_pos), torch.full_like(t.adv, config.tau_neg))
    gate = (4.0 / tau) * torch.sigmoid(tau * (t.ratio - 1.0))
    token_loss = -(gate * t.adv) * t.maskf
    loss = aggregate_loss(token_loss, mask, agg, num_global_tokens, num_global_seqs, token_weights, denominator)
    return loss, ratio_metrics(t, token_loss)
