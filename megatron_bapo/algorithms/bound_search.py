"""BAPO adaptive clip-bound search in one pass over the tokens and one collective.

The paper's Algorithm 1 (and the official recipe) re-evaluate the positive/negative contribution
over every token after each bound change: up to ~50 full passes, each with an all-reduce and a host
sync. Every such evaluation is a function of two vectors over the bound grid only:

    P[k] = positive contribution with c_high = c_high_k      (k = 0..K)
    N[j] = negative contribution with c_low  = c_low_j       (j = 0..J)

because positive tokens depend only on c_high and negative tokens only on c_low (design §4). So we
bucketize each token's ratio into the grid once, scatter-add its contribution into a bin, turn the
bins into P and N with a prefix/suffix sum, all-reduce the concatenated vector once (float64, so
every rank holds bit-identical sums) and walk the search path on the host. Every rank then takes
the identical decision without further communication.

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

# Extra entries appended to the all-reduced vector: counts that ride along for free.
_NUM_EXTRA = 4  # num_nonfinite, num_tokens, num_pos_tokens, num_neg_tokens


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


def bound_grid(start: float, stop: float, step: float, *, clamp_to_stop: bool) -> torch.Tensor:
    """Grid `start + i * step` for i = 0..floor((stop - start) / step + 1e-9), float64.

    With `clamp_to_stop` (the official recipe's `min(c + step, max)`), `stop` is appended when the
    last on-grid value falls short of it.
    """
    num = int(math.floor((stop - start) / step + 1e-9))
    values = [start + i * step for i in range(num + 1)]
    if clamp_to_stop and stop - values[-1] > 1e-9 * max(1.0, abs(stop)):
        values.append(stop)
    return torch.tensor(values, dtype=torch.float64)


def balance_metric(pos: float, neg: float, metric: str) -> float:
    """Positive-contribution balance from the sums P and N (design §4).

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


def contribution_vectors(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: BapoConfig,
    high_grid: torch.Tensor,
    low_grid: torch.Tensor,
    rollout_logprobs: Optional[torch.Tensor] = None,
    *,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Local (this rank's) `[P (len high_grid), N (len low_grid), extras]` in float64, one pass.

    Shapes: `ratio`, `advantages`, `mask` (and `rollout_logprobs`) are equal-shaped, any rank.
    Masked-out tokens are ignored entirely (their values may be anything, including NaN).
    Ratios are compared with the grid in the ratio's own dtype, as the loss compares them.
    `chunk_size` bounds the temporaries (default: 64k tokens on CPU, where cache-sized chunks are
    several times faster; the whole tensor on accelerators).
    """
    device = ratio.device
    num_k, num_j = high_grid.numel(), low_grid.numel()
    cmp_dtype = ratio.dtype if ratio.is_floating_point() else torch.float64
    high_cmp = _GridCounter(high_grid, high_grid.to(device=device, dtype=cmp_dtype), config.high_step, inclusive=False)
    low_cmp = _GridCounter(low_grid, low_grid.to(device=device, dtype=cmp_dtype), config.low_step, inclusive=True)
    if chunk_size is None:
        chunk_size = 1 << 16 if device.type == "cpu" else max(ratio.numel(), 1)

    flat = [x.detach().reshape(-1) for x in (ratio, advantages, mask)]
    if config.weight == "rollout_prob":
        flat.append(rollout_logprobs.detach().reshape(-1))
    num_bins = num_k + num_j + 3  # positive bins [0, num_k], negative bins, one dump bin
    bins_r = torch.zeros(num_bins, dtype=torch.float64, device=device)
    bins_a = torch.zeros(num_bins, dtype=torch.float64, device=device) if config.contribution == "surrogate" else None
    counts = torch.zeros(_NUM_EXTRA, dtype=torch.float64, device=device)
    for start in range(0, flat[0].numel(), chunk_size):
        chunk = [x[start : start + chunk_size] for x in flat]
        _bin_chunk(chunk, config, high_cmp, low_cmp, bins_r, bins_a, counts)

    pos_bins = num_k + 1
    dump = num_bins - 1
    pos_r, neg_r = bins_r[:pos_bins], bins_r[pos_bins:dump]
    high64, low64 = high_grid.to(device), low_grid.to(device)
    if config.contribution == "gradient":
        # P[k] = sum over positives with bin <= k;  N[j] = sum over negatives with bin > j.
        p_vec = torch.cumsum(pos_r, 0)[:num_k]
        n_vec = _suffix_sum(neg_r)[1:]
    else:
        # surrogate: P[k] = sum w A min(r, ch_k), N[j] = sum w |A| max(r, cl_j): tokens inside the
        # bound contribute w|A| r, the others w|A| * bound.
        pos_a, neg_a = bins_a[:pos_bins], bins_a[pos_bins:dump]
        p_vec = torch.cumsum(pos_r, 0)[:num_k] + high64 * (pos_a.sum() - torch.cumsum(pos_a, 0)[:num_k])
        n_vec = _suffix_sum(neg_r)[1:] + low64 * torch.cumsum(neg_a, 0)[:num_j]
    return torch.cat([p_vec, n_vec, counts])


class _GridCounter:
    """Exact `#grid < r` (or `<= r`) per token for a (nearly) uniform grid, without a binary search.

    The grid is `start + i * step` (the last value may be clamped to the stop, `order="verl"`),
    compared in the ratio's dtype. When every grid value, as compared, lies within step/8 of its
    ideal position `x_i`, the count of ideal positions below `r - step/4` is a lower bound of the
    true count and at most one less (the band is narrower than one step), so one gather-and-compare
    makes it exact. The margin (step/8) also absorbs the float32 rounding of the estimate itself.
    Grids that fail the check (a clamped last value far from its ideal position, a coarse dtype
    with a tiny step) use `torch.searchsorted`, ~3x slower on CPU.
    """

    def __init__(self, grid64: torch.Tensor, grid_cmp: torch.Tensor, step: float, *, inclusive: bool) -> None:
        self.grid_cmp = grid_cmp
        self.inclusive = inclusive
        self.size = grid64.numel()
        self.inv_step = 1.0 / step
        start = float(grid64[0])
        ideal = start + step * torch.arange(self.size, dtype=torch.float64)
        err = (grid_cmp.to(torch.float64).cpu() - ideal).abs()
        self.uniform = bool((err < step / 8).all()) and grid_cmp.is_floating_point()
        # strict:    #{x_i <  y} = ceil((y - start) / step);  inclusive: #{x_i <= y} = floor((y - start) / step) + 1,
        # both at y = r - step/4, written as (r - origin) * inv_step.
        self.origin = start + step / 4 if not inclusive else start + step / 4 - step
        self.above = torch.cat([grid_cmp, grid_cmp.new_tensor([math.nan])])  # NaN: never step past the end
        # float32 estimates are enough when their rounding stays far inside the 1/8-step margin.
        span = abs(float(grid64[-1])) + abs(self.origin) + step
        self.est_float32 = 2 * span * 2.0**-24 / step + (self.size + 1) * 2.0**-24 < 1 / 16

    def count(self, r: torch.Tensor) -> torch.Tensor:
        """`#grid < r` (`<= r` when inclusive) as int64. `r` must be NaN-free (callers zero those tokens)."""
        if not self.uniform:
            return torch.searchsorted(self.grid_cmp, r, right=self.inclusive)
        est_dtype = torch.float32 if self.est_float32 and r.dtype != torch.float64 else torch.float64
        z = (r.to(est_dtype) - self.origin).mul_(self.inv_step)
        z = z.floor_() if self.inclusive else z.ceil_()
        c = z.clamp_(0, self.size).to(torch.int64)
        # index_select: several times faster than advanced indexing for a small table on CPU.
        up = self.above.index_select(0, c)
        return c.add_(up <= r if self.inclusive else up < r)


def _bin_chunk(chunk, config, high_cmp, low_cmp, bins_r, bins_a, counts) -> None:
    """Accumulate one chunk of tokens into the grid bins (in place, float64).

    A positive token counts for every k with c_high_k >= r (its bin is #high < r), a negative one
    for every j with c_low_j <= r (its bin is #low <= r); `high_cmp`/`low_cmp` are `_GridCounter`s.
    Written for few passes over memory: this function is the whole cost of the search.
    """
    r, a, m = chunk[0], chunk[1], chunk[2].to(torch.bool)
    # x - x is 0 for finite x and NaN for NaN/inf: one subtraction instead of isfinite's several ops.
    probe = (r - r).add_(a - a)
    if len(chunk) == 4:
        probe.add_(chunk[3] - chunk[3])
    finite = probe == 0
    counted_in = m & finite
    pos = counted_in & (a > 0)
    neg_all = counted_in & (a < 0)
    neg = neg_all
    if config.contribution == "gradient" and config.dual_clip is not None:
        neg = neg & (r <= config.dual_clip)
    counts += torch.stack([m.sum() - counted_in.sum(), counted_in.sum(), pos.sum(), neg_all.sum()]).to(counts.dtype)

    num_k = high_cmp.size
    r_idx = r.nan_to_num(0.0)  # the counters need NaN-free input; NaN tokens get zero weight below
    index = torch.where(pos, high_cmp.count(r_idx), low_cmp.count(r_idx).add_(num_k + 1))

    # Tokens outside the counted set get zero weight (masked_fill also clears their NaN/inf), so
    # they never reach P or N wherever their index points.
    skip = ~(pos | neg)
    mag = a.to(torch.float64).abs_()
    if len(chunk) == 4:
        mag *= chunk[3].to(torch.float64).exp()
    mag.masked_fill_(skip, 0.0)
    size = bins_r.numel()
    bins_r += torch.bincount(index, weights=(mag * r.to(torch.float64)).masked_fill_(skip, 0.0), minlength=size)
    if bins_a is not None:
        bins_a += torch.bincount(index, weights=mag, minlength=size)


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.flip(torch.cumsum(torch.flip(x, (0,)), 0), (0,))


def search_clip_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: BapoConfig,
    *,
    rollout_logprobs: Optional[torch.Tensor] = None,
    group: Optional["torch.distributed.ProcessGroup"] = None,
) -> BoundSearchResult:
    """Choose `(c_low, c_high)` for one optimizer step, exactly as the configured search loop would.

    Args:
        ratio: importance ratios `exp(logp - logp_behavior)` with the current parameters, any shape.
        advantages: per-token advantages, same shape.
        mask: 1 for tokens in the loss, 0 otherwise, same shape.
        config: search space, contribution definition, weights, metric, order.
        rollout_logprobs: behavior log-probs, required when `config.weight == "rollout_prob"`.
        group: process group holding the rest of the mini-batch (data-parallel x context-parallel);
            None means this process holds all of it. Exactly one all-reduce is issued over it.

    Returns the decision, bit-identical on every rank of `group`.
    Raises ValueError (on every rank alike) when any masked-in input is NaN or inf.
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
    clamp = config.order == "verl"
    high_grid = bound_grid(config.high_start, config.high_max, config.high_step, clamp_to_stop=clamp)
    low_grid = bound_grid(config.low_start, config.low_max, config.low_step, clamp_to_stop=clamp)

    vec = contribution_vectors(ratio, advantages, mask, config, high_grid, low_grid, rollout_logprobs)
    if group is not None:
        torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.SUM, group=group)
    sums = vec.cpu().tolist()  # the only host sync
    num_k, num_j = high_grid.numel(), low_grid.numel()
    p_vec, n_vec = sums[:num_k], sums[num_k : num_k + num_j]
    num_nonfinite, num_tokens, num_pos, num_neg = (int(x) for x in sums[num_k + num_j :])
    if num_nonfinite:
        raise ValueError(
            f"search_clip_bounds: {num_nonfinite} loss tokens have NaN/inf ratio, advantage or rollout log-prob "
            "(across the reduction group); check the log-probs and rewards feeding this step"
        )

    k, j, steps = _walk(p_vec, n_vec, config)
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
    )


def _walk(p_vec: list[float], n_vec: list[float], config: BapoConfig) -> tuple[int, int, int]:
    """Walk the search path over precomputed sums; returns (k, j, num_steps)."""
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
