"""The clipped policy-gradient loss shared by BAPO, GRPO and clip-higher (only the bounds differ).

Per token t (loss-masked tokens excluded), with r = exp(logp - logp_behavior):

    A > 0:  term = r A,            clipped (constant c_high A) iff r > c_high
    A < 0:  term = r A,            clipped (constant c_low A)  iff r < c_low
                                   dual-clipped (constant c A)  iff r > c   (when dual_clip is set)
    loss_t = -term

which is `-min(r A, clip(r, c_low, c_high) A)` with dual clip, written with explicit masks so that
the gradient convention is exact: a token passes gradient iff its ratio is inside the closed bounds
(the same convention the bound search counts).

Aggregation and why the denominator is global: with "token-mean" the loss of a micro-batch is
`sum(loss_t) / num_global_tokens`, where `num_global_tokens` counts loss tokens in the whole
mini-batch over all micro-batches and data-parallel ranks. Summing these micro-batch losses (what
gradient accumulation and the DP all-reduce do) then gives exactly the single-process mean over the
mini-batch, whatever the split. A per-micro-batch mean would over-weight short micro-batches.
Every mode is a weighted token sum `sum(w_t loss_t) / D` (`aggregation_weights`); a caller that
splits sequences across ranks or packs them (context parallel, THD) computes `w` and `D` on the
whole mini-batch and passes them in (`token_weights`, `denominator`).

Extreme ratios: the log-ratio is clamped to +-LOG_RATIO_LIMIT before exp(), so a finite but extreme
behavior log-prob (a server bug, a token the current policy all but forbids) cannot overflow the
ratio into inf and then NaN (an inf in the unselected branch of the clipped term still yields
`0 * inf` in its gradient). At the limit r is 4.8e8 or 2e-9: such a token is clipped, or passes a
gradient of at most that size (negative advantage without dual clip) or of essentially zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_LIMIT = 20.0
"""|logp - logp_behavior| is clamped to this before exp() (ratios in [2e-9, 4.8e8])."""


def clamped_log_ratio(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor) -> torch.Tensor:
    """`logprobs - behavior_logprobs` clamped to +-LOG_RATIO_LIMIT: the log-ratio the loss uses, so a
    bound search over exp() of it sees exactly the loss's ratios (finite for any finite input)."""
    return (logprobs - behavior_logprobs.to(logprobs.dtype)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def aggregation_weights(mask: torch.Tensor, agg: str) -> tuple[torch.Tensor, float]:
    """Per-token weights `w` and denominator `D` with `agg(loss) == sum(w * loss_t) / D`.

    mask: `[B, T]` loss mask of the WHOLE mini-batch (the last dim is the sequence).
    token-mean: w = mask, D = number of loss tokens; seq-mean-token-mean: w = mask / (loss tokens of
    the row), D = rows with a loss token; seq-mean-token-sum: w = mask, D = rows with a loss token.
    D is at least 1. The weights travel with their tokens through any split (micro-batches, DP, CP,
    packing), so every split sums to the same loss.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"aggregation_weights: agg must be one of {AGG_MODES}, got {agg!r}")
    m = mask.to(torch.float64)
    if agg == "token-mean":
        return m, max(float(m.sum()), 1.0)
    seq_tokens = m.sum(-1, keepdim=True)
    num_seqs = max(float((seq_tokens > 0).sum()), 1.0)
    if agg == "seq-mean-token-mean":
        return m / seq_tokens.clamp(min=1.0), num_seqs
    return m, num_seqs


def loss_token_weights(aggregation: torch.Tensor, correction: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's weight `a_t c_t` in the applied loss `sum(a_t c_t loss_t) / D`: its aggregation
    weight (`aggregation_weights` over the whole mini-batch, any shape) times its importance correction
    (`algorithms.importance`, same shape; None: 1), in the aggregation weights' dtype.

    The one definition of the weights the loss applies (`token_weights` of every loss) and the
    balance counts (`token_weights` of `search_clip_bounds` / `Objective.search`): the gradient of
    token t is `a_t c_t d term_t / d logp_t / D`, so with these weights the searched positive share
    is the applied gradient's under every `loss_agg` (a sequence mean gives each sequence's tokens
    `1 / its length`, which a search counting tokens alone would ignore)."""
    return aggregation if correction is None else aggregation * correction.to(aggregation.dtype)


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    c_low: float,
    c_high: float,
    *,
    dual_clip: Optional[float] = 3.0,
    agg: str = "token-mean",
    num_global_tokens: Optional[float] = None,
    num_global_seqs: Optional[float] = None,
    token_weights: Optional[torch.Tensor] = None,
    denominator: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy loss and its reduction-ready statistics.

    Args:
        logprobs: current log-probs of the taken tokens, `[B, T]` (any shape for token-mean),
            requires grad.
        behavior_logprobs: log-probs under the policy that generated the tokens, same shape.
        advantages: per-token advantages, same shape.
        mask: 1 for tokens in the loss, same shape.
        c_low, c_high: importance-ratio bounds (e.g. 0.6 and 1.2).
        dual_clip: constant c > 1 for negative advantages; None disables dual clip.
        agg: "token-mean" (default), "seq-mean-token-mean" or "seq-mean-token-sum"; the seq modes
            treat the last dimension as the sequence.
        num_global_tokens: token-mean denominator over all micro-batches and DP ranks; None uses
            this call's own token count (single-process use).
        num_global_seqs: seq-mean denominator (sequences with at least one loss token, globally);
            None uses this call's own count.
        token_weights, denominator: precomputed aggregation (`aggregation_weights` over the whole
            mini-batch, same shape as `mask`): the loss is `sum(token_weights * loss_t) /
            denominator` and `agg` / `num_global_*` are not used. For callers whose tokens of one
            sequence are split or packed (the actor).

    Returns:
        loss: scalar; summing it over the micro-batches of a mini-batch (and over DP ranks) gives
            the mini-batch loss.
        metrics: detached float64 sums and counts (`num_tokens`, `num_pos_tokens`,
            `num_neg_tokens`, `num_clipped_pos`, `num_clipped_neg`, `num_dual_clipped`,
            `num_seqs`, `sum_kl_k1`, `sum_kl_k3`, `sum_ratio`, `sum_loss`);
            sum them across micro-batches / ranks, then call `finalize_loss_metrics`.
    """
    if not c_low < c_high:
        raise ValueError(f"policy_loss: c_low ({c_low}) must be < c_high ({c_high})")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"policy_loss: dual_clip must be > 1 or None, got {dual_clip}")
    t = loss_inputs("policy_loss", logprobs, behavior_logprobs, advantages, mask, agg, token_weights, denominator)
    clipped_pos = t.pos & (t.ratio > c_high)
    clipped_low = t.neg & (t.ratio < c_low)
    dual = t.neg & (t.ratio > dual_clip) if dual_clip is not None else torch.zeros_like(t.neg)
    passes = t.keep & ~clipped_pos & ~clipped_low & ~dual

    # Clipped tokens contribute a constant (no gradient); passing tokens contribute r A.
    bound = torch.zeros_like(t.adv).masked_fill(clipped_pos, c_high).masked_fill(clipped_low, c_low)
    if dual_clip is not None:
        bound = bound.masked_fill(dual, dual_clip)
    term = torch.where(passes, t.ratio * t.adv, bound * t.adv)
    token_loss = -term * t.maskf
    loss = aggregate_loss(token_loss, mask, agg, num_global_tokens, num_global_seqs, token_weights, denominator)
    metrics = ratio_metrics(t, token_loss, num_clipped_pos=clipped_pos, num_clipped_neg=clipped_low,
                            num_dual_clipped=dual)
    return loss, metrics


@dataclass(frozen=True)
class LossInputs:
    """What every policy loss derives from its inputs first (`loss_inputs`)."""

    keep: torch.Tensor
    """bool: the token is in the loss."""
    maskf: torch.Tensor
    """`keep` in the log-probs' dtype."""
    log_ratio: torch.Tensor
    """`clamped_log_ratio` on loss tokens, 0 elsewhere (padding never reaches exp())."""
    ratio: torch.Tensor
    """exp(log_ratio), differentiable in the log-probs."""
    adv: torch.Tensor
    """advantages in the log-probs' dtype."""
    pos: torch.Tensor
    """bool: loss token with A > 0."""
    neg: torch.Tensor
    """bool: loss token with A < 0."""


def loss_inputs(name: str, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, agg: str, token_weights: Optional[torch.Tensor],
                denominator: Optional[float]) -> LossInputs:
    """Checks shared by every policy loss (`name` prefixes the errors) and its per-token inputs.

    Padding may hold arbitrary log-probs (NaN, inf): they are kept out of exp(), so no `inf * 0`
    NaN reaches a gradient."""
    if agg not in AGG_MODES:
        raise ValueError(f"{name}: agg must be one of {AGG_MODES}, got {agg!r}")
    if not (logprobs.shape == behavior_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"{name}: logprobs, behavior_logprobs, advantages and mask must have one shape, got "
            f"{tuple(logprobs.shape)}, {tuple(behavior_logprobs.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    if (token_weights is None) != (denominator is None):
        raise ValueError(f"{name}: token_weights and denominator go together")
    keep = mask.to(torch.bool)
    log_ratio = torch.where(keep, clamped_log_ratio(logprobs, behavior_logprobs), torch.zeros_like(logprobs))
    adv = advantages.to(logprobs.dtype)
    return LossInputs(keep=keep, maskf=mask.to(logprobs.dtype), log_ratio=log_ratio, ratio=torch.exp(log_ratio),
                      adv=adv, pos=keep & (adv > 0), neg=keep & (adv < 0))


def aggregate_loss(token_loss: torch.Tensor, mask: torch.Tensor, agg: str, num_global_tokens: Optional[float],
                   num_global_seqs: Optional[float], token_weights: Optional[torch.Tensor],
                   denominator: Optional[float]) -> torch.Tensor:
    """`sum(w_t loss_t) / D`: with `token_weights` / `denominator` given (the whole mini-batch's
    `aggregation_weights`), else this call's own weights for `agg` and the global counts when given."""
    if token_weights is None:
        token_weights, denominator = aggregation_weights(mask, agg)
        if agg == "token-mean" and num_global_tokens is not None:
            denominator = num_global_tokens
        elif agg != "token-mean" and num_global_seqs is not None:
            denominator = num_global_seqs
    return (token_weights.to(token_loss.dtype) * token_loss).sum() / _safe(denominator)


def ratio_metrics(t: LossInputs, token_loss: torch.Tensor, **counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """The detached float64 statistics every loss returns (see `policy_loss`); `counts` are bool
    masks counted under their names (`num_clipped_pos`, `num_clipped_neg`, `num_dual_clipped`;
    missing ones count 0)."""
    with torch.no_grad():
        lr64 = t.log_ratio.detach().to(torch.float64)
        m64 = t.maskf.detach().to(torch.float64)
        zero = torch.zeros((), dtype=torch.float64, device=m64.device)
        metrics = {
            "num_tokens": m64.sum(),
            "num_seqs": (m64.sum(-1) > 0).sum().to(torch.float64) if m64.dim() > 0 else m64.sum(),
            "num_pos_tokens": t.pos.sum().to(torch.float64),
            "num_neg_tokens": t.neg.sum().to(torch.float64),
            **{k: counts[k].sum().to(torch.float64) if k in counts else zero
               for k in ("num_clipped_pos", "num_clipped_neg", "num_dual_clipped")},
            # KL(behavior || current) estimated on behavior samples: k1 = -log r, k3 = r - 1 - log r.
            "sum_kl_k1": (-lr64 * m64).sum(),
            "sum_kl_k3": ((lr64.exp() - 1.0 - lr64) * m64).sum(),
            "sum_ratio": (lr64.exp() * m64).sum(),
            "sum_loss": token_loss.detach().to(torch.float64).sum(),
        }
    return metrics


def _safe(denom) -> torch.Tensor | float:
    if isinstance(denom, torch.Tensor):
        return denom.clamp(min=1.0)
    return max(float(denom), 1.0)


def finalize_loss_metrics(sums: dict[str, float], prefix: str = "actor/") -> dict[str, float]:
    """Turn summed `policy_loss` statistics (over micro-batches and ranks) into logged fractions."""
    num = max(sums.get("num_tokens", 0.0), 1.0)
    num_pos = max(sums.get("num_pos_tokens", 0.0), 1.0)
    num_neg = max(sums.get("num_neg_tokens", 0.0), 1.0)
    return {
        f"{prefix}pos_token_frac": sums.get("num_pos_tokens", 0.0) / num,
        f"{prefix}clipfrac_pos": sums.get("num_clipped_pos", 0.0) / num_pos,
        f"{prefix}clipfrac_neg": (sums.get("num_clipped_neg", 0.0) + sums.get("num_dual_clipped", 0.0)) / num_neg,
        f"{prefix}clipfrac_dual": sums.get("num_dual_clipped", 0.0) / num_neg,
        f"{prefix}clipfrac": (
            sums.get("num_clipped_pos", 0.0) + sums.get("num_clipped_neg", 0.0) + sums.get("num_dual_clipped", 0.0)
        )
        / num,
        f"{prefix}kl_k1": sums.get("num_tokens", 0.0) and sums.get("sum_kl_k1", 0.0) / num,
        f"{prefix}kl": sums.get("num_tokens", 0.0) and sums.get("sum_kl_k3", 0.0) / num,
        f"{prefix}ratio_mean": sums.get("sum_ratio", 0.0) / num if sums.get("num_tokens", 0.0) else 1.0,
    }
