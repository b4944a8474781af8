"""Split a global batch into mini-batches, data-parallel shards and token-budget micro-batches.

Every rank holds the same global batch, so every rank computes the same partition locally with no
communication: DP shards are balanced by token count (longest sequence first onto the lightest
shard), and each shard is cut into the SAME number of micro-batches (the largest count any shard
needs under the token budget), which `search_scope: microbatch` and pipeline schedules require.
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


def _num_microbatches(lengths: list[int], budget: int, cost: CostFn) -> int:
    """Micro-batches needed for rows of `lengths` (sorted descending) packed first-fit in order."""
    count, group = 0, []
    for n in lengths:
        if group and cost(group + [n]) > budget:
            count, group = count + 1, []
        group.append(n)
    return count + (1 if group else 0)


def split_microbatches(
    rows: list[int], lengths: Sequence[int], num_microbatches: int, cost: CostFn = padded_cost
) -> list[list[int]]:
    """Cut `rows` into exactly `num_microbatches` groups of similar cost (some may be empty).

    Rows are sorted by length (longest first) and dealt to the group with the smallest cost so far,
    keeping groups of similar lengths together.
    """
    order = sorted(rows, key=lambda i: (-int(lengths[i]), i))
    groups: list[list[int]] = [[] for _ in range(num_microbatches)]
    costs = [0] * num_microbatches
    for i in order:
        g = min(range(num_microbatches), key=lambda k: (costs[k], k))
        groups[g].append(i)
        costs[g] = cost([int(lengths[j]) for j in groups[g]])
    return [sorted(g) for g in groups]


def plan_microbatches(
    lengths: Sequence[int], dp_size: int, max_tokens_per_microbatch: int, cost: CostFn = padded_cost
) -> list[list[list[int]]]:
    """`plan[dp_rank][k]` = row indices of micro-batch k on that rank; equal counts on all ranks.

    `cost(lengths)` is the tokens a micro-batch of sequences of these lengths occupies (padded:
    rows x longest; packed: the sum), compared with `max_tokens_per_microbatch`.
    """
    shards = balanced_dp_shards(lengths, dp_size)
    need = [
        _num_microbatches(sorted((int(lengths[i]) for i in s), reverse=True), max_tokens_per_microbatch, cost)
        for s in shards
    ]
    count = max(max(need), 1)
    return [split_microbatches(s, lengths, count, cost) for s in shards]
