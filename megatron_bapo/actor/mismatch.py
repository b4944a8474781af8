"""Training-inference mismatch metrics (`mismatch/*`): the trainer's log-probs against the rollout's.

Measured once per `train_step`, BEFORE any update of the step, on loss tokens bucketed by their
version lag: the trainer's policy version minus the version that sampled the token. Lag 0 (the
servers held exactly the trainer's weights) is pure training-inference mismatch: dtype, kernels,
a wrong temperature, penalties, pre-temperature log-probs. Lags 1, 2, 3+ add the policy's own
drift since the token was sampled, so the two are told apart.

Per bucket, with d_t = logp_train_t - logp_rollout_t over its loss tokens:

| metric | value |
|---|---|
| `abs_diff_mean`, `abs_diff_max` | mean and max of abs(d) |
| `kl_k3` | mean of exp(d) - 1 - d: the k3 estimate of KL(rollout || train) on the rollout's samples |
| `seq_ratio_min`, `seq_ratio_max` | min / max over sequences of exp(mean of d over the sequence's tokens of the bucket) |
| `frac_outside_band` | share of tokens whose ratio exp(d) lies outside `MismatchConfig.band` |
| `num_tokens` | loss tokens in the bucket (`num_nonfinite`: excluded, non-finite d) |

Lag 0 is logged as `mismatch/<metric>`, the others as `mismatch/lag1/<metric>`, `lag2`, `lag3plus`;
a bucket without tokens logs only its counts. Which tokens are measured: with
`old_logprobs: recompute` every token of the batch (the recompute pass); with `rollout` those of
the first mini-batch (its training forward, which runs before the first update: no extra pass).

Sums live on the device; `reduce` runs one SUM and one MAX all-reduce over the group holding the
rest of the batch (data x context parallel: a sequence split over CP ranks adds up), and
`finalize` turns them into a fixed-size vector the other pipeline stages can receive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_bapo.algorithms.importance import check_band
from megatron_bapo.algorithms.policy_loss import LOG_RATIO_LIMIT

BUCKETS = ("", "lag1/", "lag2/", "lag3plus/")
"""Metric prefixes of the version-lag buckets 0, 1, 2, 3+."""
FINAL_KEYS = ("num_tokens", "num_nonfinite", "abs_diff_mean", "abs_diff_max", "kl_k3", "seq_ratio_min",
              "seq_ratio_max", "frac_outside_band")
_SUMS = 5  # per bucket: tokens, sum abs(d), sum k3, tokens outside the band, non-finite tokens
_LIKELY_CAUSES = (
    "a temperature other than the trainer's (rollout.sampling.temperature), sampling penalties or a logit bias "
    "on the servers, servers returning pre-temperature log-probs (SGLANG_RETURN_ORIGINAL_LOGPROB), or servers "
    "computing in another dtype or model than the trainer's"
)


@dataclass(frozen=True)
class MismatchConfig:
    """How the `mismatch/*` metrics count and when they warn."""

    band: tuple[float, float] = (0.5, 2.0)
    """A token's train/rollout ratio exp(d) outside [low, high] counts in `mismatch/frac_outside_band`."""
    warn_kl: Optional[float] = 1e-2
    """Warn once (naming the likely causes) when the first update's lag-0 `mismatch/kl_k3` exceeds
    this; bf16 servers against an fp32 trainer stay far below it. None disables the warning."""

    def __post_init__(self) -> None:
        check_band(self.band, "MismatchConfig.band")
        if self.warn_kl is not None and (isinstance(self.warn_kl, bool) or not isinstance(self.warn_kl, (int, float))
                                         or not self.warn_kl >= 0):
            raise ValueError(f"MismatchConfig.warn_kl must be a number >= 0 or null, got {self.warn_kl!r}")


class MismatchSums:
    """Accumulates the mismatch statistics of one step's measured tokens on `device`."""

    def __init__(self, num_seqs: int, config: MismatchConfig, device: torch.device) -> None:
        self.config = config
        self.num_seqs = num_seqs
        self.sums = torch.zeros(len(BUCKETS), _SUMS, dtype=torch.float64, device=device)
        self.seq = torch.zeros(max(num_seqs, 1), len(BUCKETS), 2, dtype=torch.float64, device=device)
        self.maxes = torch.zeros(len(BUCKETS), dtype=torch.float64, device=device)

    def add(self, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor, lag: torch.Tensor,
            seq_index: torch.Tensor) -> None:
        """Add tokens (equal shapes): trainer and rollout log-probs, loss mask, version lag, and the
        token's sequence in [0, num_seqs) (ignored off the mask)."""
        dev = self.sums.device
        d = logprobs.detach().to(dev, torch.float64) - behavior_logprobs.to(dev, torch.float64)
        on = mask.to(dev) > 0
        ok = on & torch.isfinite(d)
        d = torch.where(ok, d, 0.0)
        bucket = torch.where(on, lag.to(dev).clamp(0, len(BUCKETS) - 1).long(), 0)
        ratio = d.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
        low, high = self.config.band
        okf = ok.to(torch.float64)
        per_token = torch.stack([okf, d.abs() * okf, (ratio - 1.0 - d) * okf,
                                 ((ratio < low) | (ratio > high)).to(torch.float64) * okf,
                                 (on & ~ok).to(torch.float64)], dim=-1).reshape(-1, _SUMS)
        flat_bucket = bucket.reshape(-1)
        self.sums.index_add_(0, flat_bucket, per_token)
        abs_d = (d.abs() * okf).reshape(-1)
        self.maxes.scatter_reduce_(0, flat_bucket, abs_d, reduce="amax")
        seq = torch.where(on, seq_index.to(dev).long(), 0).reshape(-1)
        cell = seq * len(BUCKETS) + flat_bucket
        pairs = torch.stack([d.reshape(-1), okf.reshape(-1)], dim=-1)
        self.seq.view(-1, 2).index_add_(0, cell, pairs)

    def reduce(self, group: Optional["dist.ProcessGroup"]) -> None:
        """Sum (and max) over the ranks holding the rest of the measured tokens; no-op for None."""
        if group is None or dist.get_world_size(group) == 1:
            return
        flat = torch.cat([self.sums.reshape(-1), self.seq.reshape(-1)])
        dist.all_reduce(flat, group=group)
        self.sums.copy_(flat[: self.sums.numel()].view_as(self.sums))
        self.seq.copy_(flat[self.sums.numel():].view_as(self.seq))
        dist.all_reduce(self.maxes, op=dist.ReduceOp.MAX, group=group)

    def finalize(self) -> torch.Tensor:
        """`[len(BUCKETS) * len(FINAL_KEYS)]` float64 on the device (NaN where a bucket is empty)."""
        n = self.sums[:, 0]
        denom = n.clamp(min=1.0)
        count = self.seq[..., 1]
        geo = (self.seq[..., 0] / count.clamp(min=1.0)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
        has = count > 0
        seq_min = torch.where(has, geo, math.inf).amin(0)
        seq_max = torch.where(has, geo, -math.inf).amax(0)
        out = torch.stack([n, self.sums[:, 4], self.sums[:, 1] / denom, self.maxes, self.sums[:, 2] / denom,
                           seq_min, seq_max, self.sums[:, 3] / denom], dim=-1)
        empty = (n == 0).unsqueeze(-1) & torch.tensor([False, False] + [True] * 6, device=out.device)
        return torch.where(empty, math.nan, out).reshape(-1)


def mismatch_metrics(vec: torch.Tensor) -> dict[str, float]:
    """`finalize`'s vector as `mismatch/*` metrics (an empty bucket logs only its counts)."""
    values = vec.reshape(len(BUCKETS), len(FINAL_KEYS)).tolist()
    out: dict[str, float] = {}
    for prefix, row in zip(BUCKETS, values):
        for key, value in zip(FINAL_KEYS, row):
            if key.startswith("num_") or row[0] > 0:
                out[f"mismatch/{prefix}{key}"] = value
    return out


def warn_if_large(metrics: dict[str, float], config: MismatchConfig, log, *, emit: bool = True) -> bool:
    """Warn (once per run: the caller remembers; only where `emit`, e.g. global rank 0) when the lag-0
    KL exceeds `warn_kl`; returns whether the check could run (there were lag-0 tokens)."""
    if not metrics.get("mismatch/num_tokens"):
        return False
    kl = metrics["mismatch/kl_k3"]
    if emit and config.warn_kl is not None and kl > config.warn_kl:
        log.warning(
            "training-inference mismatch on the first update: KL(rollout || train) = %.3g (mismatch/kl_k3, %d tokens "
            "sampled with the trainer's weights) > actor.mismatch.warn_kl=%g; mean |d log p| %.3g, %.1f%% of ratios "
            "outside %s. Likely causes: %s. actor.old_logprobs: recompute (+ actor.correction) takes the ratio against "
            "the trainer's own log-probs", kl, int(metrics["mismatch/num_tokens"]), config.warn_kl,
            metrics["mismatch/abs_diff_mean"], 100 * metrics["mismatch/frac_outside_band"], list(config.band),
            _LIKELY_CAUSES)
    return True
