"""Per-step actor metrics: which statistics are summed over ranks, and how they become fractions.

Loss statistics are sums/counts (from `policy_loss`) that are summed over micro-batches on a rank,
all-reduced over the DP x CP group on the last pipeline stage and broadcast to the other stages, so
every rank reports the same numbers. Bound-search decisions are already identical on every rank of
the reduction group and are only broadcast. Staleness is computed from the global batch, which
every rank holds, so it needs no communication.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

from megatron_bapo.algorithms.policy_loss import finalize_loss_metrics

SUM_KEYS = (
    "num_tokens", "num_seqs", "num_pos_tokens", "num_neg_tokens", "num_clipped_pos", "num_clipped_neg",
    "num_dual_clipped", "sum_kl_k1", "sum_kl_k3", "sum_ratio", "sum_loss", "sum_entropy", "sum_objective",
    "count", "sum_is_weight", "num_is_masked",
)
SEARCH_KEYS = ("c_low", "c_high", "rho_before", "rho_after", "search_steps", "num_searches")


def acc_keys() -> tuple[str, ...]:
    """Layout of `MetricSums.vector()`."""
    return SUM_KEYS + SEARCH_KEYS


class MetricSums:
    """Accumulates `SUM_KEYS` over micro-batches and `SEARCH_KEYS` over searches, on `device`.

    The loss statistics are device tensors; summing them where they are costs no host sync per
    micro-batch (the actor brings the totals to the host once per optimizer step).
    """

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=self.device)
        self.search = torch.zeros(len(SEARCH_KEYS), dtype=torch.float64, device=self.device)

    def add_stats(self, stats: dict) -> None:
        present = [i for i, k in enumerate(SUM_KEYS) if k in stats]
        values = torch.stack([torch.as_tensor(stats[SUM_KEYS[i]], dtype=torch.float64).to(self.device).reshape(())
                              for i in present])
        self.sums[present] += values

    def add_search(self, c_low: float, c_high: float, rho_before: float, rho_after: float, steps: int) -> None:
        values = torch.tensor([c_low, c_high, rho_before, rho_after, steps, 1.0], dtype=torch.float64)
        self.search += values.to(self.device)

    def vector(self) -> torch.Tensor:
        return torch.cat([self.sums, self.search])

    @staticmethod
    def finalize(vec: torch.Tensor) -> dict[str, float]:
        n = len(SUM_KEYS)
        sums = dict(zip(SUM_KEYS, vec[:n].tolist()))
        search = dict(zip(SEARCH_KEYS, vec[n:].tolist()))
        out = finalize_loss_metrics(sums, prefix="actor/")
        num = max(sums["num_tokens"], 1.0)
        out["actor/entropy"] = sums["sum_entropy"] / num
        out["actor/loss"] = sums["sum_objective"] / max(sums["count"], 1.0)
        out["actor/num_loss_tokens"] = sums["num_tokens"]
        # The importance corrections of old_logprobs recompute (1 and 0 without one).
        out["correction/weight_mean"] = sums["sum_is_weight"] / num
        out["correction/masked_frac"] = sums["num_is_masked"] / num
        k = max(search["num_searches"], 1.0)
        for key in ("c_low", "c_high", "rho_before", "rho_after", "search_steps"):
            if key in ("c_low", "c_high") and search["num_searches"] > 0 and math.isnan(search[key]):
                continue  # a loss without bounds (sapo): its balance is measured, nothing is searched
            out[f"bapo/{key}"] = search[key] / k
        return out


def average_steps(steps: Iterable[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over optimizer steps, ignoring NaN (skipped steps); NaN if all are NaN."""
    steps = list(steps)
    out: dict[str, float] = {}
    for k in dict.fromkeys(k for s in steps for k in s):  # a skipped step lacks e.g. the moe/* keys
        vals = [s[k] for s in steps if k in s and not math.isnan(s[k])]
        out[k] = sum(vals) / len(vals) if vals else float("nan")
    return out


def staleness_metrics(
    versions: Optional[torch.Tensor],
    loss_mask: torch.Tensor,
    current_version: Optional[int],
    schedule: Sequence[slice],
) -> dict[str, float]:
    """Staleness in OPTIMIZER STEPS over the loss tokens of each optimizer step of a train_step.

    `schedule[k]` are the rows of the k-th optimizer step. A token of policy version v trained in
    step k is `(current - v) * len(schedule) + k` optimizer steps behind the weights that train it
    (every earlier version was followed by `len(schedule)` steps; mini-batch k of this call is k
    steps staler than mini-batch 0). `current_version` None means the newest version in the batch.
    Buckets `staleness/frac_0`, `frac_1`, `frac_2`, `frac_3plus` count (token, step) pairs, plus
    mean and max; `staleness/version_lag_max` is the largest lag in policy versions (what
    `rollout.max_staleness` caps).
    """
    if versions is None:
        return {}
    keep = loss_mask > 0
    if not bool(keep.any()):
        return {"staleness/mean": 0.0, "staleness/max": 0.0, "staleness/version_lag_max": 0.0}
    cur = float(versions[keep].max()) if current_version is None else float(current_version)
    steps = len(schedule)
    s = torch.cat([(cur - versions[sl][keep[sl]].to(torch.float64)) * steps + k for k, sl in enumerate(schedule)])
    out = {"staleness/mean": float(s.mean()), "staleness/max": float(s.max()),
           "staleness/version_lag_max": cur - float(versions[keep].min())}
    for b in (0, 1, 2):
        out[f"staleness/frac_{b}"] = float((s == b).double().mean())
    out["staleness/frac_3plus"] = float((s >= 3).double().mean())
    return out


def finite(x: float) -> bool:
    return math.isfinite(x)
