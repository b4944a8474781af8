"""The step's policy loss (`actor.policy_loss`) and how its trust region is chosen, behind one interface.

    objective = Objective("dppo", bapo=..., dppo=...)
    result = objective.search(lp, ref, adv, mask, ...)          # one collective: the step's parameters
    loss, stats = objective.loss(lp, ref, adv, mask, result.bounds, ...)

| `policy_loss` | module | parameters `(lower, upper)` searched with an adaptive `actor.bapo` |
|---|---|---|
| `ppo_clip` (default) | `policy_loss` | `(c_low, c_high)`: BAPO itself (`search_clip_bounds`) |
| `dppo` | `dppo` | `(delta_low, delta_high)`: `balance.search_dppo` |
| `cispo` | `cispo` | `(c_low, c_high)`, the cap only: `balance.search_cispo` |
| `sapo` | `sapo` | none: its positive share is measured (`balance.measure_sapo`) |

Every loss takes the same inputs (log-probs, the ratio's reference, advantages, the loss mask, the
global aggregation: `token_weights` = aggregation weight x importance correction, `denominator`) and
returns the same statistics, so the actor does not know which one runs; `search` counts each token's
contribution with the same `token_weights`. `checks.check_objective` refuses the combinations that
cannot run (at config load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_bapo.algorithms.balance import NonfiniteTokens, measure_sapo, search_cispo, search_dppo
from megatron_bapo.algorithms.bound_search import BoundSearchResult, search_clip_bounds
from megatron_bapo.algorithms.checks import POLICY_LOSSES, check_objective
from megatron_bapo.algorithms.cispo import CispoConfig, cispo_loss
from megatron_bapo.algorithms.config import BapoConfig
from megatron_bapo.algorithms.dppo import DppoConfig, dppo_loss
from megatron_bapo.algorithms.policy_loss import clamped_log_ratio, policy_loss
from megatron_bapo.algorithms.sapo import SapoConfig, sapo_loss

@dataclass(frozen=True)
class Objective:
    """A policy loss with its configs; see the module docstring."""

    name: str = "ppo_clip"
    bapo: BapoConfig = field(default_factory=BapoConfig)
    dppo: DppoConfig = field(default_factory=DppoConfig)
    cispo: CispoConfig = field(default_factory=CispoConfig)
    sapo: SapoConfig = field(default_factory=SapoConfig)

    def __post_init__(self) -> None:
        check_objective(self.name, self.bapo, self.dppo, self.cispo)

    def search(self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, *, rollout_logprobs: Optional[torch.Tensor] = None,
               token_weights: Optional[torch.Tensor] = None, group=None,
               raise_nonfinite: bool = True) -> BoundSearchResult:
        """The step's parameters `(result.c_low, result.c_high)` and balance, identical on every rank of
        `group` (one all-reduce). Shapes: any, all equal; `ref_logprobs` is the ratio's reference,
        `rollout_logprobs` the behavior log-probs (for `weight: rollout_prob`), `token_weights` the
        weights `loss` applies (`loss_token_weights`: aggregation weight x importance correction; the
        same tensor), so the balance is the applied gradient's. `raise_nonfinite=False`: NaN/inf loss tokens give
        the start parameters with `num_nonfinite` set (as `search_clip_bounds` does), for a caller
        that agrees on skipping with the other pipeline stages."""
        kw = dict(rollout_logprobs=rollout_logprobs, token_weights=token_weights, group=group)
        if self.name == "ppo_clip":
            ratio = torch.exp(clamped_log_ratio(logprobs.detach(), ref_logprobs) * mask)
            return search_clip_bounds(ratio, advantages, mask, self.bapo, raise_nonfinite=raise_nonfinite, **kw)
        try:
            if self.name == "dppo":
                return search_dppo(logprobs, ref_logprobs, advantages, mask, self.dppo, self.bapo, **kw)
            if self.name == "cispo":
                return search_cispo(logprobs, ref_logprobs, advantages, mask, self.cispo, self.bapo, **kw)
            return measure_sapo(logprobs, ref_logprobs, advantages, mask, self.sapo, self.bapo, **kw)
        except NonfiniteTokens as exc:
            if raise_nonfinite:
                raise
            low, high = ((self.dppo.lower, self.dppo.upper) if self.name == "dppo"
                         else (self.cispo.c_low, self.cispo.c_high) if self.name == "cispo"
                         else (self.bapo.low_start, self.bapo.high_start))
            return BoundSearchResult(c_low=float(low), c_high=float(high), rho=0.0, rho_initial=0.0, num_steps=0,
                                     pos_contribution=0.0, neg_contribution=0.0, num_tokens=0, num_pos_tokens=0,
                                     num_neg_tokens=0, num_nonfinite=exc.count)

    def loss(self, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             bounds: tuple[float, float], *, token_weights: torch.Tensor,
             denominator: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss with the step's `bounds` (`(c_low, c_high)` of `search`) and the global aggregation
        (`token_weights` = aggregation weights x importance corrections, `denominator`); the contract of
        `policy_loss`."""
        kw = dict(token_weights=token_weights, denominator=denominator)
        if self.name == "ppo_clip":
            return policy_loss(logprobs, ref_logprobs, advantages, mask, bounds[0], bounds[1],
                               dual_clip=self.bapo.dual_clip, **kw)
        if self.name == "dppo":
            return dppo_loss(logprobs, ref_logprobs, advantages, mask, self.dppo, delta_low=bounds[0],
                             delta_high=bounds[1], **kw)
        if self.name == "cispo":
            return cispo_loss(logprobs, ref_logprobs, advantages, mask, self.cispo, c_high=bounds[1], **kw)
        return sapo_loss(logprobs, ref_logprobs, advantages, mask, self.sapo, **kw)
