"""BAPO configuration: the clip-bound search space, the balance definition, and presets.

Every field is validated at construction so a bad YAML value fails at job start with the field's
name, not three days in (design §8). Presets reproduce design §4: they all share one loss; only the
way the clip bounds are chosen differs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

CONTRIBUTIONS = ("gradient", "surrogate")
WEIGHTS = ("none", "rollout_prob")
METRICS = ("share", "printed", "pos_neg")
ORDERS = ("paper", "verl")


@dataclass(frozen=True)
class BapoConfig:
    """How the clip bounds `(c_low, c_high)` are searched for each optimizer step.

    Bounds are importance-ratio bounds (e.g. 0.6 and 1.2), not PPO epsilons. The search walks an
    integer grid `c_high_k = high_start + k * high_step`, `c_low_j = low_start + j * low_step`
    (never accumulated floats) until the positive-contribution balance reaches `rho0`.
    A preset with `low_start == low_max` and `high_start == high_max` is a fixed clip (GRPO).
    """

    rho0: float = 0.4
    """Target balance; the search stops once `metric >= rho0`."""
    low_start: float = 0.6
    """a-: first (smallest) lower bound."""
    low_max: float = 0.9
    """b-: largest lower bound the search may reach."""
    high_start: float = 1.2
    """a+: first (smallest) upper bound."""
    high_max: float = 3.0
    """b+: largest upper bound the search may reach."""
    high_step: float = 0.05
    """delta1: grid step of the upper bound."""
    low_step: float = 0.02
    """delta2: grid step of the lower bound."""
    contribution: str = "gradient"
    """"gradient": only tokens that pass gradient count, by |A| r; "surrogate": the paper's surrogate values."""
    weight: str = "none"
    """"none" (w=1) or "rollout_prob" (w = exp(behavior log-prob), the paper's equation)."""
    metric: str = "share"
    """"share" P/(P+N), "printed" P/|P-N| (paper, literal), "pos_neg" P/N (official recipe)."""
    order: str = "paper"
    """"paper": Algorithm 1 (raise c_high first, then c_low); "verl": the official recipe (c_low, then c_high)."""
    dual_clip: Optional[float] = 3.0
    """Dual-clip constant c for negative advantages (clip iff r > c); None disables it."""

    def __post_init__(self) -> None:
        for name in ("rho0", "low_start", "low_max", "high_start", "high_max", "high_step", "low_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"BapoConfig.{name} must be a finite number, got {value!r}")
        if self.low_start <= 0:
            raise ValueError(f"BapoConfig.low_start must be > 0 (a ratio bound such as 0.6), got {self.low_start}")
        if self.low_start > self.low_max:
            raise ValueError(
                f"BapoConfig.low_start ({self.low_start}) must be <= low_max ({self.low_max}): the search only raises c_low"
            )
        if self.high_start > self.high_max:
            raise ValueError(
                f"BapoConfig.high_start ({self.high_start}) must be <= high_max ({self.high_max}): the search only raises c_high"
            )
        if self.low_max >= self.high_start:
            raise ValueError(
                f"BapoConfig.low_max ({self.low_max}) must be < high_start ({self.high_start}) so that c_low < c_high"
            )
        # Bounds are ratios: a token the policy has not moved (r = 1) passes on both sides.
        if self.low_max > 1.0:
            raise ValueError(f"BapoConfig.low_max={self.low_max} must be <= 1: a lower ratio bound above 1 clips "
                             f"negative tokens the policy has not moved (r = 1); bounds are ratios such as 0.6 -> 0.9")
        if self.high_start < 1.0:
            raise ValueError(f"BapoConfig.high_start={self.high_start} must be >= 1: an upper ratio bound below 1 "
                             f"clips positive tokens the policy has not moved (r = 1); bounds are ratios such as 1.2, "
                             f"not epsilons such as 0.2")
        if self.high_step <= 0:
            raise ValueError(f"BapoConfig.high_step must be > 0, got {self.high_step}")
        if self.low_step <= 0:
            raise ValueError(f"BapoConfig.low_step must be > 0, got {self.low_step}")
        if self.contribution not in CONTRIBUTIONS:
            raise ValueError(f"BapoConfig.contribution must be one of {CONTRIBUTIONS}, got {self.contribution!r}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"BapoConfig.weight must be one of {WEIGHTS}, got {self.weight!r}")
        if self.metric not in METRICS:
            raise ValueError(f"BapoConfig.metric must be one of {METRICS}, got {self.metric!r}")
        if self.order not in ORDERS:
            raise ValueError(f"BapoConfig.order must be one of {ORDERS}, got {self.order!r}")
        if self.metric == "share" and not 0.0 <= self.rho0 <= 1.0:
            raise ValueError(f"BapoConfig.rho0 must be in [0, 1] for metric 'share' (a fraction), got {self.rho0}")
        if self.rho0 < 0:
            raise ValueError(f"BapoConfig.rho0 must be >= 0, got {self.rho0}")
        if self.dual_clip is not None:
            if isinstance(self.dual_clip, bool) or not isinstance(self.dual_clip, (int, float)):
                raise ValueError(f"BapoConfig.dual_clip must be a number or null, got {self.dual_clip!r}")
            if not self.dual_clip > max(1.0, self.low_max):
                raise ValueError(f"BapoConfig.dual_clip must be > 1 (typically 3.0) or null to disable, got {self.dual_clip}")
        if self.num_high_steps > 10_000 or self.num_low_steps > 10_000:
            raise ValueError(
                "BapoConfig grid is too fine: (high_max - high_start) / high_step and (low_max - low_start) / low_step "
                f"must each be <= 10000 (got {self.num_high_steps} and {self.num_low_steps})"
            )

    @property
    def num_high_steps(self) -> int:
        """K = floor((b+ - a+) / delta1): index of the last on-grid upper bound."""
        return int(math.floor((self.high_max - self.high_start) / self.high_step + 1e-9))

    @property
    def num_low_steps(self) -> int:
        """J = floor((b- - a-) / delta2): index of the last on-grid lower bound."""
        return int(math.floor((self.low_max - self.low_start) / self.low_step + 1e-9))

    @property
    def is_adaptive(self) -> bool:
        """False for fixed-clip presets (GRPO, clip-higher), whose search never moves."""
        return self.low_max > self.low_start or self.high_max > self.high_start

    def replace(self, **changes: Any) -> "BapoConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "BapoConfig":
        """Named configurations of design §4; `overrides` replace single fields afterwards."""
        try:
            fields = _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown BAPO preset {name!r}; choose one of {sorted(_PRESETS)}") from None
        return cls(**{**fields, **overrides})


_PRESETS: dict[str, dict[str, Any]] = {
    # Ours: exact gradient balance, share metric, paper search order, paper defaults.
    "bapo": dict(contribution="gradient", weight="none", metric="share", order="paper"),
    # The paper's equation read literally: surrogate values weighted by the rollout probability.
    "bapo-paper": dict(contribution="surrogate", weight="rollout_prob", metric="printed", order="paper"),
    # The official verl recipe (recipe/bapo): P/N >= 0.5, c_low 0.8->0.95 by 0.05, then c_high 1.2->2.0 by 0.1.
    "bapo-verl": dict(
        contribution="surrogate",
        weight="none",
        metric="pos_neg",
        order="verl",
        rho0=0.5,
        low_start=0.8,
        low_max=0.95,
        low_step=0.05,
        high_start=1.2,
        high_max=2.0,
        high_step=0.1,
    ),
    # Fixed clips: the grid is a single point, so the same code path never moves the bounds.
    "grpo": dict(low_start=0.8, low_max=0.8, high_start=1.2, high_max=1.2),
    "clip-higher": dict(low_start=0.8, low_max=0.8, high_start=1.28, high_max=1.28),
}

PRESETS = tuple(_PRESETS)
