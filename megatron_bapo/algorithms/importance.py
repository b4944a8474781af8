"""Training-inference mismatch corrections: per-token importance weights for a recomputed old policy.

With `actor.old_logprobs: recompute` PPO's ratio is taken against the trainer's own log-probs at
the start of the step, `r_t = pi_theta(y_t) / pi_old(y_t)`, while the tokens were sampled by the
rollout servers, `pi_rollout` (other kernels, often bf16). The decoupled objective (Hilton et al.
2021; AReaL, verl) corrects for that with the behavior importance weight

    w_t = pi_old(y_t) / pi_rollout(y_t) = exp(logp_old_t - logp_behavior_t)
    J   = E_{y ~ pi_rollout}[ sum_t c_t * min(r_t A_t, clip(r_t, c_low, c_high) A_t) ] / D

where `c_t` is one of the corrections below (a constant of the step: no gradient flows through it):

- `none`:    c_t = 1 (the behavior log-probs only feed the `mismatch/*` metrics);
- `tis`:     c_t = min(w_t, C), truncated importance sampling (Yao et al. 2025): bounded variance,
             a bias where the rollout under-rates a token by more than C;
- `mis`:     c_t = w_t if a <= w_t <= b else 0, masked importance sampling (IcePop): tokens the two
             engines disagree on beyond the band are dropped instead of truncated;
- `seq_mis`: c_t = 1 if a <= g_s <= b else 0 for every token of sequence s, with
             g_s = exp(mean of log w over the sequence's loss tokens), the geometric-mean ratio
             (verl's geometric rejection): whole sequences are kept or dropped.

A masked token stays in the denominator D (the mask multiplies the token's term, as in IcePop):
dropping a few tokens shrinks the step a little instead of re-weighting the others.

Safety: `log w` is clamped to +-LOG_RATIO_LIMIT before exp(), so an extreme but finite log-prob gives
a finite weight (truncated by `tis`, masked by `mis`); a non-finite `log w` (NaN or inf log-prob
on either side) gets weight 0, and under `seq_mis` masks its whole sequence. Weights are 0 off the
loss mask. Nothing non-finite is ever returned.

Pure torch, no Megatron: the actor computes the weights once per step from its recompute pass,
multiplies them into each token's aggregation weight (`policy_loss.loss_token_weights`) and passes
that one tensor to the loss and to the bound search (`token_weights` of both), so the search sums
exactly the gradient mass the loss applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bapo.algorithms.policy_loss import LOG_RATIO_LIMIT

CORRECTIONS = ("none", "tis", "mis", "seq_mis")


@dataclass(frozen=True)
class CorrectionConfig:
    """Which importance correction `actor.old_logprobs: recompute` applies (module docstring)."""

    mode: str = "none"
    """"none", "tis" (truncate w at `tis_cap`), "mis" (mask tokens with w outside `band`) or "seq_mis"
    (mask sequences whose geometric-mean w leaves `band`)."""
    tis_cap: float = 2.0
    """C of `tis`: a token's weight is min(w, C) (2.0 as in Yao et al.)."""
    band: tuple[float, float] = (0.5, 2.0)
    """[a, b] of `mis` (on each token's w) and of `seq_mis` (on each sequence's geometric mean of w).
    Sequence means are far less noisy than tokens: verl's geometric rejection uses [0.999, 1.001]."""

    def __post_init__(self) -> None:
        if self.mode not in CORRECTIONS:
            raise ValueError(f"CorrectionConfig.mode must be one of {CORRECTIONS}, got {self.mode!r}")
        if isinstance(self.tis_cap, bool) or not isinstance(self.tis_cap, (int, float)) or not (
                math.isfinite(self.tis_cap) and self.tis_cap >= 1):
            raise ValueError(f"CorrectionConfig.tis_cap must be a finite number >= 1 (e.g. 2.0): a cap below 1 would "
                             f"also shrink tokens the engines agree on (w = 1); got {self.tis_cap!r}")
        check_band(self.band, "CorrectionConfig.band")


def check_band(band, name: str) -> None:
    """A ratio band `[low, high]` must satisfy 0 <= low < 1 < high < inf (an on-policy token, w = 1, is inside)."""
    if not (isinstance(band, (tuple, list)) and len(band) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in band)):
        raise ValueError(f"{name} must be two numbers [low, high], got {band!r}")
    low, high = float(band[0]), float(band[1])
    if not (0.0 <= low < 1.0 < high < math.inf):
        raise ValueError(f"{name}={list(band)} must satisfy 0 <= low < 1 < high (the band holds w = 1), "
                         "e.g. [0.5, 2.0]")


def log_importance(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log w, ok)` in float64: log w = old - behavior clamped to +-LOG_RATIO_LIMIT (0 where not ok);
    ok = on the loss mask and finite. Shapes: any, all equal."""
    raw = old_logprobs.detach().to(torch.float64) - behavior_logprobs.detach().to(torch.float64)
    ok = (mask > 0) & torch.isfinite(raw)
    return torch.where(ok, raw, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT), ok


def tis_weights(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """Truncated IS: `min(w, cap)` on finite loss tokens, 0 elsewhere (float32, the inputs' shape)."""
    log_w, ok = log_importance(old_logprobs, behavior_logprobs, mask)
    return torch.where(ok, log_w.exp().clamp(max=cap), 0.0).float()


def mis_weights(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                band: tuple[float, float]) -> torch.Tensor:
    """Masked IS: `w` where `band[0] <= w <= band[1]` on finite loss tokens, 0 elsewhere (float32)."""
    log_w, ok = log_importance(old_logprobs, behavior_logprobs, mask)
    w = log_w.exp()
    return torch.where(ok & (w >= band[0]) & (w <= band[1]), w, 0.0).float()


def sequence_log_ratio_sums(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                            seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """`[num_seqs, 3]` float64 per sequence: (sum of log w over its finite loss tokens, number of its
    loss tokens, number of its non-finite loss tokens). `seq_index` holds each token's sequence in
    [0, num_seqs) (anything off the loss mask is ignored). Sums of a sequence split across ranks
    (context parallel) or micro-batches add up: reduce them before `seq_mis_weights`."""
    log_w, ok = log_importance(old_logprobs, behavior_logprobs, mask)
    on = mask > 0
    index = torch.where(on, seq_index.long(), 0).reshape(-1)
    values = torch.stack([log_w, on.to(torch.float64), (on & ~ok).to(torch.float64)], dim=-1).reshape(-1, 3)
    values = values * on.reshape(-1, 1)
    out = torch.zeros(num_seqs, 3, dtype=torch.float64, device=log_w.device)
    return out.index_add_(0, index, values)


def seq_mis_weights(mask: torch.Tensor, seq_index: torch.Tensor, seq_sums: torch.Tensor,
                    band: tuple[float, float]) -> torch.Tensor:
    """Sequence-level masked IS: 1 on the loss tokens of sequences whose geometric-mean ratio
    `exp(sum log w / num tokens)` lies in `band` and that have no non-finite token, else 0 (float32).
    `seq_sums`: `sequence_log_ratio_sums` summed over every rank holding part of a sequence."""
    count = seq_sums[:, 1]
    mean = seq_sums[:, 0] / count.clamp(min=1.0)
    geo = mean.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    keep_seq = (count > 0) & (seq_sums[:, 2] == 0) & (geo >= band[0]) & (geo <= band[1])
    on = mask > 0
    keep = keep_seq[torch.where(on, seq_index.long(), 0)] & on
    return keep.float()


def importance_weights(old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                       config: CorrectionConfig, *, seq_index: Optional[torch.Tensor] = None,
                       seq_sums: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The correction `c_t` of `config.mode` for every token (float32, 0 off the loss mask).

    `seq_mis` needs `seq_index` and the reduced `seq_sums` (`sequence_log_ratio_sums`)."""
    if config.mode == "tis":
        return tis_weights(old_logprobs, behavior_logprobs, mask, config.tis_cap)
    if config.mode == "mis":
        return mis_weights(old_logprobs, behavior_logprobs, mask, config.band)
    if config.mode == "seq_mis":
        if seq_index is None or seq_sums is None:
            raise ValueError("importance_weights: mode 'seq_mis' needs seq_index and seq_sums")
        return seq_mis_weights(mask, seq_index, seq_sums, config.band)
    return (mask > 0).float()
