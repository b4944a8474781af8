"""BAPO adaptive clip-bound search in one pass over the tokens and one collective.

The paper's Algorithm 1 (and the official recipe) re-evaluate the positive/negative contribution
over every token after each bound change: up to ~50 full passes, each with an all-reduce and a host
sync. Every such evaluation is a function of two vectors over the bound grid only:

    P[k] = positive contribution with c_high = c_high_k      (k = 0..K)
    N[j] = negative contribution with c_low  = c_low_j       (j = 0..J)

because positive tokens depend only on c_high and negative tokens only on c_low (design section 4). So we
bucketize each token's ratio into the grid once, scatter-add its contribution into a bin, turn the
bins into P and N with a prefix/suffix sum (`algorithms.contribution_bins`, the one pass), all-reduce
the concatenated vector once (float64, so every rank holds bit-identical sums) and walk the search
path on the host. Every rank then takes the identical decision without further communication.

Tie convention: a positive token passes gradient iff r <= c_high, a negative one iff
c_low <= r (<= dual_clip); i.e. a token is clipped iff its ratio lies strictly outside the bounds.
The loss (`policy_loss`) uses the same convention, so `gradient` sums are exactly the gradient mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_bapo.algorithms.config import BapoConfig
from megatron_bapo.algorithms.contribution_bins import contribution_vectors



@dataclass(frozen=True)
class BoundSearchResult:
    """The decision of one search, identical on every rank of the reduction group."""

    c_low: float
    c_high: float
    rho: float
    """Balance metric at the chosen bounds."""
    rho_initial: float
    """Balance metric at the start of the search (low_start, high_start)."""
    num_steps: int
    """Number of bound changes the search made."""
    pos_contribution: float
    """P at the chosen c_high (summed over the group)."""
    neg_contribution: float
    """N at the chosen c_low (summed over the group)."""
    num_tokens: int
    num_pos_tokens: int
    num_neg_tokens: int
    num_nonfinite: int = 0
    """Loss tokens with a NaN/inf input (across the group); nonzero only with `raise_nonfinite=False`,
    and then the bounds are the search's start, not a decision."""


def grid_values(start: float, stop: float, step: float, *, clamp_to_stop: bool) -> list[float]:
    """`start + i * step` for i = 0..floor((stop - start) / step + 1e-9) (integer steps, never an
    accumulated float). With `clamp_to_stop` (the official recipe's `min(c + step, max)`), `stop`
    is appended when the last on-grid value falls short of it."""
    num = int(math.floor((stop - start) / step + 1e-9))
    values = [start + i * step for i in range(num + 1)]
    if clamp_to_stop and stop - values[-1] > 1e-9 * max(1.0, abs(stop)):
        values.append(stop)
    return values


def bound_grid(start: float, stop: float, step: float, *, clamp_to_stop: bool) -> torch.Tensor:
    """`grid_values` as a float64 tensor: the grid a search walks."""
    return torch.tensor(grid_values(start, stop, step, clamp_to_stop=clamp_to_stop), dtype=torch.float64)


def balance_metric(pos: float, neg: float, metric: str) -> float:
    """Positive-contribution balance from the sums P and N (design section 4).

    share   = P / (P + N), 1 when P + N == 0 (nothing to balance: the search does not move)
    printed = P / |P - N|, the paper's denominator read literally; inf when P == N > 0, 1 when both are 0
    pos_neg = P / N (official recipe), inf when N == 0
    """
    if metric == "share":
        total = pos + neg
        return 1.0 if total == 0.0 else pos / total
    if metric == "printed":
        diff = abs(pos - neg)
        if diff == 0.0:
            return 1.0 if pos == 0.0 else math.inf
        return pos / diff
    if metric == "pos_neg":
        return math.inf if neg == 0.0 else pos / neg
    raise ValueError(f"unknown balance metric {metric!r}; choose share, printed or pos_neg")


def search_clip_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: BapoConfig,
    *,
    rollout_logprobs: Optional[torch.Tensor] = None,
    token_weights: Optional[torch.Tensor] = None,
    group: Optional["torch.distributed.ProcessGroup"] = None,
    raise_nonfinite: bool = True,
) -> BoundSearchResult:
    """Choose `(c_low, c_high)` for one optimizer step, exactly as the configured search loop would.

    Args:
        ratio: importance ratios `exp(logp - logp_behavior)` with the current parameters, any shape.
        advantages: per-token advantages, same shape.
        mask: 1 for tokens in the loss, 0 otherwise, same shape.
        config: search space, contribution definition, weights, metric, order.
        rollout_logprobs: behavior log-probs, required when `config.weight == "rollout_prob"`.
        token_weights: per-token weights >= 0 that multiply each token's contribution, same shape:
            the weights the loss applies (`loss_token_weights`: aggregation weight x importance
            correction), so the search sums exactly the gradient mass the loss applies under any
            `loss_agg`. None: 1 for every token (token-mean without a correction).
        group: process group holding the rest of the mini-batch (data-parallel x context-parallel);
            None means this process holds all of it. Exactly one all-reduce is issued over it, on
            the device its backend carries (`reduction_device`): the sums cost nothing to move
            (a few hundred floats), so the inputs may live on the host or the device with any group.
        raise_nonfinite: when any masked-in input is NaN or inf, raise ValueError (on every rank of
            `group` alike); False: return the start bounds with `num_nonfinite` set, for a caller that
            must agree with ranks outside `group` (other pipeline stages) before it skips the step.

    Returns the decision, bit-identical on every rank of `group`.
    """
    if ratio.shape != advantages.shape or ratio.shape != mask.shape:
        raise ValueError(
            f"search_clip_bounds: ratio {tuple(ratio.shape)}, advantages {tuple(advantages.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    if config.weight == "rollout_prob":
        if rollout_logprobs is None:
            raise ValueError("search_clip_bounds: config.weight='rollout_prob' needs rollout_logprobs (behavior log-probs)")
        if rollout_logprobs.shape != ratio.shape:
            raise ValueError(
                f"search_clip_bounds: rollout_logprobs {tuple(rollout_logprobs.shape)} must match ratio {tuple(ratio.shape)}"
            )
    if token_weights is not None and token_weights.shape != ratio.shape:
        raise ValueError(
            f"search_clip_bounds: token_weights {tuple(token_weights.shape)} must match ratio {tuple(ratio.shape)}"
        )
    clamp = config.order == "verl"
    high_grid = bound_grid(config.high_start, config.high_max, config.high_step, clamp_to_stop=clamp)
    low_grid = bound_grid(config.low_start, config.low_max, config.low_step, clamp_to_stop=clamp)

    vec = contribution_vectors(ratio, advantages, mask, config, high_grid, low_grid, rollout_logprobs,
                               token_weights=token_weights)
    if group is not None:
        vec = vec.to(reduction_device(group, vec.device))
        torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.SUM, group=group)
    sums = vec.cpu().tolist()  # the only host sync
    num_k, num_j = high_grid.numel(), low_grid.numel()
    p_vec, n_vec = sums[:num_k], sums[num_k : num_k + num_j]
    num_nonfinite, num_tokens, num_pos, num_neg = (int(x) for x in sums[num_k + num_j :])
    if num_nonfinite and raise_nonfinite:
        raise ValueError(
            f"search_clip_bounds: {num_nonfinite} loss tokens have NaN/inf ratio, advantage, rollout log-prob or weight "
            "(across the reduction group); check the log-probs and rewards feeding this step"
        )

    k, j, steps = (0, 0, 0) if num_nonfinite else walk_path(p_vec, n_vec, config)
    rho_initial = balance_metric(p_vec[0], n_vec[0], config.metric)
    return BoundSearchResult(
        c_low=float(low_grid[j]),
        c_high=float(high_grid[k]),
        rho=balance_metric(p_vec[k], n_vec[j], config.metric),
        rho_initial=rho_initial,
        num_steps=steps,
        pos_contribution=p_vec[k],
        neg_contribution=n_vec[j],
        num_tokens=num_tokens,
        num_pos_tokens=num_pos,
        num_neg_tokens=num_neg,
        num_nonfinite=num_nonfinite,
    )


def reduction_device(group: "torch.distributed.ProcessGroup", device: torch.device) -> torch.device:
    """Where a tensor must be for a collective over `group`, preferring `device` when it will do.

    NCCL carries only CUDA tensors (megatron's default-backend groups on GPUs); a gloo group gets
    host tensors (gloo can reduce CUDA tensors too, but through host staging, and the result is
    wanted on the host anyway).
    """
    backend = str(torch.distributed.get_backend(group))
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def walk_path(p_vec: list[float], n_vec: list[float], config: BapoConfig) -> tuple[int, int, int]:
    """Walk the search path over precomputed sums; returns (k, j, num_steps). `p_vec[k]` is the
    positive contribution at the k-th upper bound, `n_vec[j]` the negative one at the j-th lower
    bound; `config` gives `metric`, `rho0` and `order`."""
    last_k, last_j = len(p_vec) - 1, len(n_vec) - 1
    k = j = steps = 0

    def unmet() -> bool:
        return balance_metric(p_vec[k], n_vec[j], config.metric) < config.rho0

    if config.order == "paper":
        # Algorithm 1: while rho < rho0 and c_low + delta2 <= b-: raise c_high if it can, else c_low.
        while unmet() and j + 1 <= last_j:
            if k + 1 <= last_k:
                k += 1
            else:
                j += 1
            steps += 1
    else:
        # Official recipe: raise c_low (clamped to its max) until met, then c_high (clamped).
        while unmet() and j < last_j:
            j += 1
            steps += 1
        while unmet() and k < last_k:
            k += 1
            steps += 1
    return k, j, steps
