"""Relations among the loss settings that no single config dataclass can check, checked at config load.

Each config dataclass (`BapoConfig`, `DppoConfig`, `CispoConfig`, `SapoConfig`, `CorrectionConfig`)
checks its own fields at construction. What involves two of them is here, so a run whose settings
cannot work fails when its config loads (on every rank, exit 2) instead of at step 1 on the last
pipeline stage only, where the other stages would wait for it until the collective timeout:

- `check_objective`: `actor.policy_loss` against `actor.bapo` (and `actor.dppo` / `actor.cispo`):
  the balance must have bounds to move (not SAPO's soft gates), a contribution the loss defines
  (gradient, not PPO's surrogate sums), and a search path that can move at all; CISPO's searched
  cap must keep its floor below it and 1 inside, as `CispoConfig` requires of a fixed cap.
- `check_advantages`: the advantage estimator against the group size and dynamic sampling.

Errors are ValueError naming the fields, their values and the fix in one line (the run config turns
them into `ConfigError`). docs/bapo.md, "Settings checked at load", lists every rule.
"""

from __future__ import annotations

from megatron_bapo.algorithms.bound_search import grid_values
from megatron_bapo.algorithms.cispo import CispoConfig
from megatron_bapo.algorithms.config import BapoConfig
from megatron_bapo.algorithms.dppo import DppoConfig

POLICY_LOSSES = ("ppo_clip", "dppo", "cispo", "sapo")


def _grid_sizes(name: str, bapo: BapoConfig, dppo: DppoConfig) -> tuple[int, int]:
    """(upper, lower) grid points the search of `name` walks (ppo_clip: BAPO's; dppo: its thresholds')."""
    clamp = bapo.order == "verl"
    if name == "dppo":
        high_max, high_step, low_min, low_step = dppo.search_grid()
        return (len(grid_values(dppo.upper, high_max, high_step, clamp_to_stop=clamp)),
                len(grid_values(-dppo.lower, -low_min, low_step, clamp_to_stop=clamp)))
    return (len(grid_values(bapo.high_start, bapo.high_max, bapo.high_step, clamp_to_stop=clamp)),
            len(grid_values(bapo.low_start, bapo.low_max, bapo.low_step, clamp_to_stop=clamp)))


def check_objective(name: str, bapo: BapoConfig, dppo: DppoConfig = DppoConfig(),
                    cispo: CispoConfig = CispoConfig(), prefix: str = "actor.") -> None:
    """Raise ValueError (naming the fields, their values and the fix) for a policy loss whose balance
    cannot run as configured. A fixed `bapo` (grpo, clip-higher) only measures: nothing to check."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"{prefix}policy_loss must be one of {POLICY_LOSSES}, got {name!r}")
    if not bapo.is_adaptive:
        return
    if name == "sapo":
        raise ValueError(
            f"{prefix}policy_loss=sapo has no bounds for BAPO's adaptive search ({prefix}bapo moves c_low "
            f"{bapo.low_start}->{bapo.low_max}, c_high {bapo.high_start}->{bapo.high_max}): its gates are soft. Use a "
            f"fixed preset (bapo_preset: grpo; the positive share is still logged) or policy_loss dppo / cispo")
    if name != "ppo_clip" and bapo.contribution != "gradient":
        raise ValueError(
            f"{prefix}policy_loss={name} with {prefix}bapo.contribution={bapo.contribution!r}: the surrogate sums are "
            f"PPO's clipped values; {name}'s balance counts gradient mass. Set {prefix}bapo.contribution: gradient "
            f"(bapo_preset: bapo)")
    if name == "cispo":
        if not bapo.high_start > max(1.0, cispo.c_low):
            raise ValueError(
                f"{prefix}policy_loss=cispo searches its cap from {prefix}bapo.high_start={bapo.high_start} up, and every "
                f"cap must lie above 1 and above the floor {prefix}cispo.c_low={cispo.c_low} (as {prefix}cispo.c_high "
                f"must); set {prefix}bapo.high_start > {max(1.0, cispo.c_low)} (e.g. 1.2)")
        if len(grid_values(bapo.high_start, bapo.high_max, bapo.high_step, clamp_to_stop=bapo.order == "verl")) < 2:
            raise ValueError(
                f"{prefix}policy_loss=cispo with an adaptive {prefix}bapo whose upper grid is one point "
                f"(high_start={bapo.high_start}, high_max={bapo.high_max}, high_step={bapo.high_step}): the balance "
                f"moves only CISPO's cap, so it could never move; raise {prefix}bapo.high_max or use bapo_preset: grpo")
        return
    num_high, num_low = _grid_sizes(name, bapo, dppo)
    if name == "dppo":
        low = f"{prefix}dppo.delta_low={dppo.lower} (low_min {dppo.search_grid()[2]}, low_step {dppo.search_grid()[3]})"
    else:
        low = f"{prefix}bapo.low_start={bapo.low_start} (low_max {bapo.low_max}, low_step {bapo.low_step})"
    if bapo.order == "paper" and num_low < 2:
        raise ValueError(
            f"{prefix}bapo.order=paper with one lower grid point, {low}: Algorithm 1 searches only while the lower "
            f"bound has a next step, so the adaptive {prefix}bapo would never move ({name}); use {prefix}bapo.order: "
            f"verl, or give the lower bound a range of at least one step")
    if num_low < 2 and num_high < 2:
        raise ValueError(
            f"{prefix}bapo is adaptive but {name}'s grids are single points ({prefix}dppo.delta_high={dppo.upper}, "
            f"{low}): the balance could never move; give {prefix}dppo.high_max or low_min a range, or use "
            f"bapo_preset: grpo")


def check_advantages(estimator: str, eps: float, group_size: int, dynamic_sampling: str, *,
                     teacher_signal: bool = False) -> None:
    """Raise ValueError (naming the fields) for advantage settings that give no signal or NaN.
    `teacher_signal`: every token also gets a teacher's advantage (`algorithms.distill`), which
    needs no group."""
    if group_size < 2 and not teacher_signal:
        raise ValueError(
            f"rollout.group_size={group_size}: group-relative advantages ({estimator}) of a group of one are 0, so "
            f"nothing would train; use rollout.group_size >= 2 (the recipes use 8-16)")
    if estimator == "grpo" and eps == 0 and dynamic_sampling == "off":
        raise ValueError(
            "advantage.eps=0 with advantage.estimator=grpo divides a group of equal rewards by a zero std (NaN "
            "advantages, a skipped step); set advantage.eps > 0 (1e-6) or rollout.dynamic_sampling: filter")
