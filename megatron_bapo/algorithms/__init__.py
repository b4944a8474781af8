"""Pure-torch RL algorithm math: no Megatron import, testable on CPU in milliseconds.

- `BapoConfig` / presets: the clip-bound search space and balance definition (design §4).
- `search_clip_bounds`: BAPO's adaptive bounds in one pass over tokens and one all-reduce.
- `policy_loss`: the clipped (dual-clip) policy loss with a global token denominator.
- `dppo_loss` / `cispo_loss` / `sapo_loss`: DPPO, CISPO and SAPO with the same contract; `balance`:
  BAPO's balance applied to DPPO's and CISPO's trust regions; `Objective`: `actor.policy_loss`.
- `importance_weights` / `CorrectionConfig`: TIS / MIS / seq-MIS corrections for a recomputed old policy.
- `grpo_advantages`: group-normalised advantages (GRPO, Dr. GRPO).
- `distill.distill_advantages`: on-policy distillation's per-token advantage from a teacher's log-probs.
"""

from megatron_bapo.algorithms.advantages import dr_grpo_advantages, grpo_advantages, uniform_group_mask
from megatron_bapo.algorithms.bound_search import BoundSearchResult, balance_metric, bound_grid, search_clip_bounds
from megatron_bapo.algorithms.config import PRESETS, BapoConfig
from megatron_bapo.algorithms.cispo import CispoConfig, cispo_loss
from megatron_bapo.algorithms.dppo import DppoConfig, dppo_loss
from megatron_bapo.algorithms.importance import CORRECTIONS, CorrectionConfig, importance_weights
from megatron_bapo.algorithms.objective import POLICY_LOSSES, Objective
from megatron_bapo.algorithms.policy_loss import (
    AGG_MODES,
    aggregation_weights,
    clamped_log_ratio,
    finalize_loss_metrics,
    loss_token_weights,
    policy_loss,
)
from megatron_bapo.algorithms.sapo import SapoConfig, sapo_loss

__all__ = [
    "AGG_MODES",
    "CORRECTIONS",
    "CispoConfig",
    "CorrectionConfig",
    "DppoConfig",
    "Objective",
    "POLICY_LOSSES",
    "PRESETS",
    "BapoConfig",
    "BoundSearchResult",
    "SapoConfig",
    "aggregation_weights",
    "balance_metric",
    "bound_grid",
    "cispo_loss",
    "clamped_log_ratio",
    "dppo_loss",
    "dr_grpo_advantages",
    "finalize_loss_metrics",
    "grpo_advantages",
    "importance_weights",
    "loss_token_weights",
    "policy_loss",
    "sapo_loss",
    "search_clip_bounds",
    "uniform_group_mask",
]
