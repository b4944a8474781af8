"""Split a global batch into mini-batches, data-parallel shards and token-budget micro-batches.

Every rank holds the same global batch, so every rank computes the same partition locally with no
communication: DP shards are balanced by token count (longest sequence first onto the lightest
shard), each shard is packed first-fit decreasing into micro-batches within the token budget, and
every shard ends with the SAME number of micro-batches (the largest count any shard needs), which
`search_scope: microbatch` and pipeline schedules require.
A micro-batch's cost is the tokens the model processes for it: rows x its longest sequence when
padded, the sum of the lengths when packed (`actor.layout.MicroBatchLayout.cost` adds the rounding
that context/sequence parallelism need).
"""

from __future__ import annotations

from typing import Callable, Sequence

CostFn = Callable[[Sequence[int]], int]


def padded_cost(lengths: Sequence[int]) -> int:
    """Tokens of a right-padded micro-batch: rows x longest."""
    return len(lengths) * max(lengths) if lengths else 0


def minibatch_slices(batch_size: int, n_minibatches: int) -> list[slice]:
    """Contiguous row ranges of the mini-batches; the batch size must divide evenly."""
    if batch_size % n_minibatches:
        raise ValueError(
            f"ActorConfig.n_minibatches={n_minibatches} must divide the batch size ({batch_size} sequences)"
        )
    size = batch_size // n_minibatches
    return [slice(i * size, (i + 1) * size) for i in range(n_minibatches)]


def balanced_dp_shards(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Assign row indices to `dp_size` shards, balancing summed lengths (greedy, longest first).

    Ties go to the shard with fewer rows, then the lower shard index, so the result is
    deterministic. Shards may hold different numbers of rows; a shard may be empty when there are
    fewer rows than ranks.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in order:
        r = min(range(dp_size), key=lambda s: (loads[s], len(shards[s]), s))
        shards[r].append(i)
        loads[r] += int(lengths[i])
    return [sorted(s) for s in shards]


def pack_rows(rows: Sequence[int], lengths: Sequence[int], budget: int, cost: CostFn = padded_cost) -> list[list[int]]:
    """First-fit decreasing: rows (longest first) into micro-batches whose cost stays within `budget`.

    A row whose own cost exceeds the budget gets a micro-batch of its own.
    """
    bins: list[list[int]] = []
    for i in sorted(rows, key=lambda i: (-int(lengths[i]), i)):
        for b in bins:
            if cost([int(lengths[j]) for j in b] + [int(lengths[i])]) <= budget:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


def _split_to(bins: list[list[int]], count: int, lengths: Sequence[int], cost: CostFn) -> list[list[int]]:
    """Split the costliest micro-batches in two until there are `count` (empty ones if none can split)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [k for k, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        k = max(splittable, key=lambda k: (cost([int(lengths[j]) for j in bins[k]]), -k))
        big = bins.pop(k)
        bins += [big[0::2], big[1::2]]
    return bins


def plan_microbatches(
    lengths: Sequence[int], dp_size: int, max_tokens_per_microbatch: int, cost: CostFn = padded_cost,
    *, count_multiple: int = 1,
) -> list[list[list[int]]]:
    """`plan[dp_rank][k]` = row indices of micro-batch k on that rank; equal counts on all ranks.

    `cost(lengths)` is the tokens a micro-batch of sequences of these lengths occupies (padded:
    rows x longest; packed: the sum), kept within `max_tokens_per_microbatch` (a longer sequence
    goes alone). A rank that needs fewer micro-batches than another splits its costliest ones, and
    only a rank with fewer rows than micro-batches gets empty ones (the actor runs a no-loss filler).
    The count is rounded up to `count_multiple` (interleaved pipeline schedules need a multiple of
    the pipeline size).
    """
    shards = balanced_dp_shards(lengths, dp_size)
    packed = [pack_rows(s, lengths, max_tokens_per_microbatch, cost) for s in shards]
    count = max(max(len(p) for p in packed), 1)
    count = -(-count // count_multiple) * count_multiple
    return [[sorted(b) for b in _split_to(p, count, lengths, cost)] for p in packed]
