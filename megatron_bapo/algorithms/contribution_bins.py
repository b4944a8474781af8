"""The one pass of BAPO's bound search: every token's contribution binned into the bound grids.

`contribution_vectors` turns a rank's tokens into `[P over the c_high grid, N over the c_low grid,
counts]` (float64) in one pass; `algorithms.bound_search` all-reduces that vector once and walks the
search path over it. Positive tokens depend only on c_high and negative ones only on c_low (design
section 4), so each token lands in one bin of its grid and a prefix (suffix) sum gives P (N) at
every grid point. Written for few passes over memory in float arithmetic: this is the whole cost of
the search (`benchmarks/bench_bound_search.py`).

Tie convention (shared with the loss, `policy_loss`): a positive token passes gradient iff
r <= c_high, a negative one iff c_low <= r (<= dual_clip).
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch

from megatron_bapo.algorithms.config import BapoConfig

NUM_EXTRA = 4
"""Counts appended to the vector: num_nonfinite, num_tokens, num_pos_tokens, num_neg_tokens."""


def contribution_vectors(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: BapoConfig,
    high_grid: torch.Tensor,
    low_grid: torch.Tensor,
    rollout_logprobs: Optional[torch.Tensor] = None,
    *,
    token_weights: Optional[torch.Tensor] = None,
    values: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Local (this rank's) `[P (len high_grid), N (len low_grid), extras]` in float64, one pass.

    Shapes: `ratio`, `advantages`, `mask` (and `rollout_logprobs`, `token_weights`) are
    equal-shaped, any rank. Masked-out tokens are ignored entirely (their values may be anything,
    including NaN). `token_weights` (>= 0, e.g. `algorithms.importance` corrections) multiply each
    token's contribution, as they multiply its term in the loss.
    Ratios are compared with the grid in the ratio's own dtype, as the loss compares them.
    `chunk_size` bounds the temporaries (default: 128k tokens on CPU, where cache-sized chunks are
    several times faster; up to 2^24 tokens on accelerators, where per-chunk token counts are
    still exact in float32).

    `ratio` is the coordinate compared with the grids; `values` (`gradient` only), when given, is
    what a passing token contributes per unit of `|A|` instead of the coordinate itself: DPPO bins
    its divergence and counts its importance weight (`algorithms.balance`). `config` is a
    `BapoConfig` or any object with its `contribution`, `weight`, `dual_clip`, `high_step` and
    `low_step` (`balance.GridSpec`).
    """
    if values is not None and config.contribution != "gradient":
        raise ValueError("contribution_vectors: values are defined for the gradient contribution only")
    device = ratio.device
    num_k, num_j = high_grid.numel(), low_grid.numel()
    binner = _BinIndex(high_grid, low_grid, config, ratio.dtype, device)
    if chunk_size is None:
        chunk_size = 1 << 17 if device.type == "cpu" else 1 << 24
    chunk_size = max(1, min(chunk_size, 1 << 24))

    flat = [x.detach().reshape(-1) for x in (ratio, advantages, mask)]
    flat.append(rollout_logprobs.detach().reshape(-1) if config.weight == "rollout_prob" else None)
    flat.append(None if token_weights is None else token_weights.detach().reshape(-1))
    flat.append(None if values is None else values.detach().reshape(-1))
    num_bins = num_k + num_j + 2  # positive bins [0, num_k], negative bins [num_k + 1, num_k + 1 + num_j]
    bins_r = torch.zeros(num_bins, dtype=torch.float64, device=device)
    bins_a = torch.zeros(num_bins, dtype=torch.float64, device=device) if config.contribution == "surrogate" else None
    counts = torch.zeros(NUM_EXTRA, dtype=torch.float64, device=device)
    total = flat[0].numel()
    work = _Workspace.get(min(chunk_size, total), binner.work, advantages.dtype, device)
    for start in range(0, total, chunk_size):
        chunk = [None if x is None else x[start : start + chunk_size] for x in flat]
        _bin_chunk(chunk, config, binner, work.view(chunk[0].numel()), bins_r, bins_a, counts)

    # counts holds [nonfinite, tokens, pos - neg, -neg]: turn the last two into [pos, neg].
    counts = torch.stack([counts[0], counts[1], counts[2] - counts[3], -counts[3]])
    pos_bins = num_k + 1
    pos_r, neg_r = bins_r[:pos_bins], bins_r[pos_bins:]
    high64, low64 = high_grid.to(device), low_grid.to(device)
    if config.contribution == "gradient":
        # P[k] = sum over positives with bin <= k;  N[j] = sum over negatives with bin > j.
        p_vec = torch.cumsum(pos_r, 0)[:num_k]
        n_vec = _suffix_sum(neg_r)[1:]
    else:
        # surrogate: P[k] = sum w A min(r, ch_k), N[j] = sum w |A| max(r, cl_j): tokens inside the
        # bound contribute w|A| r, the others w|A| * bound.
        pos_a, neg_a = bins_a[:pos_bins], bins_a[pos_bins:]
        p_vec = torch.cumsum(pos_r, 0)[:num_k] + high64 * (pos_a.sum() - torch.cumsum(pos_a, 0)[:num_k])
        n_vec = _suffix_sum(neg_r)[1:] + low64 * torch.cumsum(neg_a, 0)[:num_j]
    return torch.cat([p_vec, n_vec, counts])


class _BinIndex:
    """Each token's bin: `#high < r` for a positive token, `num_k + 1 + #low <= r` for a negative one.

    Grid values are rounded to the ratio's dtype (the loss compares in it) and held in a wider
    working dtype (float32, or float64 for float64 ratios), which is exact. The inclusive count is
    made strict by storing the low grid as the previous representable value: `g <= r` iff
    `prev(g) < r`. Both grids then live in one table `[high, +inf, prev(low), +inf]`.

    Fast path, for a (nearly) uniform grid: when every table value lies within step/8 of its ideal
    position `x_i = start + i * step`, the number of ideal positions below `r - step/4` is a lower
    bound of the true count and at most one short (the band is narrower than one step), so one
    gather and one compare with the next table value make it exact. Everything stays in float
    arithmetic (CPU comparisons, bool tensors and int64 arithmetic are several times slower than
    float ops). Grids that fail the check (a clamped last value far from its ideal position, a
    coarse dtype with a tiny step) use `torch.searchsorted`, ~3x slower on CPU.
    """

    def __init__(self, high64: torch.Tensor, low64: torch.Tensor, config: BapoConfig, ratio_dtype: torch.dtype,
                 device: torch.device) -> None:
        floating = ratio_dtype.is_floating_point
        self.work = torch.float64 if ratio_dtype == torch.float64 or not floating else torch.float32
        cmp_dtype = ratio_dtype if floating else torch.float64
        self.num_k, self.num_j = high64.numel(), low64.numel()
        high = high64.to(cmp_dtype).to(self.work)
        low = low64.to(cmp_dtype).to(self.work)
        self.high, self.low = high.to(device), low.to(device)
        low_strict = torch.nextafter(low, torch.full_like(low, -math.inf))
        inf = high.new_tensor([math.inf])
        self.table = torch.cat([high, inf, low_strict, inf]).to(device)
        # The dual clip compares r <= c in the ratio's dtype, like the loss.
        dual = config.dual_clip if config.contribution == "gradient" else None
        self.dual = None if dual is None else float(torch.tensor(dual, dtype=cmp_dtype))

        def uniform(values: torch.Tensor, step: float) -> bool:
            ideal = float(values[0]) + step * torch.arange(values.numel(), dtype=torch.float64)
            return bool(((values.to(torch.float64) - ideal).abs() < step / 8).all())

        # Estimates, as one fused `c + r / step` each: #high < r >= ceil((r - high0 - step/4) / step) and
        # #low <= r >= floor((r - low0 - step/4) / step) + 1, the low one shifted to its table section.
        k1 = self.num_k + 1
        high_shift = -(float(high64[0]) + config.high_step / 4) / config.high_step
        low_shift = -(float(low64[0]) + config.low_step / 4) / config.low_step + 1 + k1
        self.high_inv, self.low_inv = 1.0 / config.high_step, 1.0 / config.low_step
        # float32 estimates are exact enough when their rounding (a few ulps of the larger of r / step,
        # the shift and the result) stays far inside the 1/8-step margin.
        ulps32 = 4 * 2.0**-24 * max(
            (max(abs(float(g[0])), abs(float(g[-1]))) + step) / step + abs(shift) + self.num_k + self.num_j + 2
            for g, step, shift in ((high64, config.high_step, high_shift), (low64, config.low_step, low_shift))
        )
        self.fast = (floating and uniform(high, config.high_step) and uniform(low_strict, config.low_step)
                     and (ulps32 < 1 / 16 or self.work == torch.float64))
        # 0-dim tensors: `torch.add(shift, r, alpha=1/step)` is one fused op, twice as fast as sub + mul.
        self.high_shift = torch.tensor(high_shift, dtype=self.work, device=device)
        self.low_shift = torch.tensor(low_shift, dtype=self.work, device=device)

    def index(self, r: torch.Tensor, neg: torch.Tensor, ws: dict) -> torch.Tensor:
        """int64 bin per token (in `ws["index"]`).

        `r`: finite ratios in the working dtype; `neg`: -1 for negative tokens, else 0.
        """
        if not self.fast:
            high = torch.searchsorted(self.high, r)
            low = torch.searchsorted(self.low, r, right=True).add_(self.num_k + 1)
            return ws["index"].copy_(torch.where(neg < 0, low, high))
        est, low, above = ws["est"], ws["low"], ws["above"]
        k1 = self.num_k + 1
        torch.add(self.high_shift, r, alpha=self.high_inv, out=est).ceil_().clamp_(0, self.num_k)
        torch.add(self.low_shift, r, alpha=self.low_inv, out=low).floor_().clamp_(k1, k1 + self.num_j)
        est.addcmul_(neg, low.sub_(est), value=-1)  # neg = -1 picks the low estimate
        # float -> int32 -> int64 is ~2x faster on CPU than float -> int64 directly.
        index = ws["index"].copy_(ws["index32"].copy_(est))
        # index_select: several times faster than advanced indexing for a small table on CPU.
        torch.index_select(self.table, 0, index, out=above)
        # +1 where the next table value is still below r; (r - above) has the exact sign of r - above.
        est += torch.sub(r, above, out=above).clamp_(0, 1).ceil_()
        return index.copy_(ws["index32"].copy_(est))


class _Workspace:
    """Chunk-sized buffers, reused by every chunk (and, on CPU, by every search of this thread).

    Fresh multi-MB temporaries per op would each be a new mapping with page faults (glibc serves
    allocations this large with mmap until its threshold adapts), which made the pass 2-3x slower
    and its time bimodal across processes on CPU. Even one fresh set per search costs 1-4 ms of
    first-touch page faults, so CPU keeps one set (~8.5 MB at the default chunk) per thread;
    accelerators allocate per search from their caching allocator.
    """

    _cpu = threading.local()

    def __init__(self, size: int, work: torch.dtype, mag: torch.dtype, device: torch.device) -> None:
        self.size, self.key = size, (work, mag, device)
        spec = {name: work for name in ("mask", "probe", "tmp", "ratio", "sign", "neg", "est", "low", "above")}
        spec.update(mag=mag, mag64=torch.float64, weight=torch.float64, index=torch.int64, index32=torch.int32)
        self.buffers = {name: torch.empty(size, dtype=dtype, device=device) for name, dtype in spec.items()}

    @classmethod
    def get(cls, size: int, work: torch.dtype, adv_dtype: torch.dtype, device: torch.device) -> "_Workspace":
        mag = torch.promote_types(adv_dtype, work) if adv_dtype.is_floating_point else work
        if device.type != "cpu":
            return cls(size, work, mag, device)
        cached = getattr(cls._cpu, "workspace", None)
        if cached is None or cached.key != (work, mag, device) or cached.size < size:
            cached = cls._cpu.workspace = cls(size, work, mag, device)
        return cached

    def view(self, size: int) -> dict:
        return {name: buf[:size] for name, buf in self.buffers.items()}


def _bin_chunk(chunk, config, binner: _BinIndex, ws: dict, bins_r, bins_a, counts) -> None:
    """Accumulate one chunk of tokens into the grid bins (in place, float64).

    A positive token counts for every k with c_high_k >= r, a negative one for every j with
    c_low_j <= r. Written for few passes over memory in float arithmetic (on CPU, comparisons,
    bool tensors and int64 arithmetic are several times slower than float ops), into the reused
    buffers of `ws`: this function is the whole cost of the search. Masked-out and zero-advantage
    tokens get zero weight (wherever their bin is); non-finite values are zeroed so they cannot
    poison the sums, and counted. `chunk`: ratio, advantages, mask, rollout log-probs (or None),
    token weights (or None), values (or None: the ratio is the value).
    """
    r, a, m, lp, tw, v = chunk
    m01, probe, tmp = ws["mask"], ws["probe"], ws["tmp"]
    # mask -> exact 0/1 in the working dtype (any nonzero, NaN included, counts as "in", like bool()).
    if m.dtype == torch.bool:
        m01.copy_(m.view(torch.uint8))
    else:
        (torch.abs(m, out=m01) if m.dtype == m01.dtype else m01.copy_(m).abs_()).clamp_(max=1).ceil_().nan_to_num_(1.0)
    # x - x is 0 for finite x and NaN for NaN/inf: one subtraction instead of isfinite's several ops.
    torch.sub(r, r, out=probe).add_(torch.sub(a, a, out=tmp))
    for extra in (lp, tw, v):
        if extra is not None:
            probe.add_(torch.sub(extra, extra, out=tmp))
    rf = torch.nan_to_num(r, 0.0, 0.0, 0.0, out=ws["ratio"])
    af = torch.nan_to_num(a, 0.0, 0.0, 0.0, out=ws["mag"])
    sign = torch.sign(af, out=ws["sign"])
    neg = torch.clamp(sign, max=0, out=ws["neg"])  # -1 for negative advantages, else 0
    # Token counts as dot products of 0/1 floats (exact below 2^24 per chunk).
    counts += torch.stack([
        torch.dot(probe.nan_to_num_(1.0), m01), m01.sum(), torch.dot(sign, m01), torch.dot(neg, m01),
    ]).to(counts.dtype)

    index = binner.index(rf, neg, ws)
    mag = af.abs_().mul_(m01)  # |A| on masked-in tokens, exact in any float dtype
    if binner.dual is not None:
        # A negative token above the dual clip passes no gradient: weight 1 + neg * [r > c] = 0.
        mag.mul_(torch.sub(rf, binner.dual, out=tmp).clamp_(0, 1).ceil_().mul_(neg).add_(1))
    if lp is not None or tw is not None or bins_a is not None:
        mag = ws["mag64"].copy_(mag)
    if lp is not None:
        # Masked-out log-probs may be huge or non-finite: exp(0) there, then times |A| * 0.
        lp0 = torch.where(m01 > 0, lp.nan_to_num(0.0, 0.0, 0.0), 0.0)
        mag.mul_(lp0.to(torch.float64).exp_())
    if tw is not None:
        mag.mul_(torch.where(m01 > 0, tw.nan_to_num(0.0, 0.0, 0.0), 0.0).to(torch.float64))
    # float32 x float32 products are exact in float64, so every rank bins the exact |A| r.
    value = ws["weight"].copy_(rf) if v is None else ws["weight"].copy_(v).nan_to_num_(0.0, 0.0, 0.0)
    bins_r.scatter_add_(0, index, value.mul_(mag))
    if bins_a is not None:
        bins_a.scatter_add_(0, index, mag)


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.flip(torch.cumsum(torch.flip(x, (0,)), 0), (0,))
