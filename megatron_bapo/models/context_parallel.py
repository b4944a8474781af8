"""Context-parallel sequence layout: which tokens a CP rank holds, and the K/V all-gather on CPU.

megatron-core's convention (and Transformer Engine's): with CP size `c`, each sequence of length `L`
(a multiple of `2c`) is cut into `2c` equal chunks and CP rank `r` holds chunks `r` and `2c-1-r`,
concatenated. Under causal attention the late chunks cost the most, so pairing an early chunk with
a late one balances the work. megatron slices RoPE the same way (`get_pos_emb_on_this_cp_rank` for
padded batches; per packed sequence via `cu_seqlens` for THD), so the token ids a rank feeds the
model must follow exactly this layout; labels are taken from the FULL sequence before slicing,
because a chunk's last token predicts the first token of a chunk another rank may hold.

Packed (THD) micro-batches apply the layout to every sequence of the pack: `cu_seqlens` holds the
global (un-split) sequence boundaries, each a multiple of `2c`, and a rank's local tokens are its
two chunks of sequence 0, then its two chunks of sequence 1, and so on (what TE's
`thd_get_partitioned_indices` returns).

`gather_along_sequence` is the CPU attention's K/V exchange: an all-gather over the CP group whose
backward sums the gradients from every rank's queries and keeps this rank's slice (a
reduce-scatter), so `cp=2` on gloo computes exactly what `cp=1` computes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def chunk_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions `[0, length)` held by `cp_rank`: chunks `cp_rank` and `2*cp_size-1-cp_rank` (long).

    `length` must be a multiple of `2 * cp_size` (cp_size 1: every position).
    """
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        raise ValueError(f"context parallel: sequence length {length} is not a multiple of 2*cp={2 * cp_size}")
    c = length // (2 * cp_size)
    lo = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    hi = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([lo, hi])


def packed_index(seq_lengths: Sequence[int], cp_size: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local layout of a THD pack on `cp_rank`.

    `seq_lengths`: global length of each packed sequence (each a multiple of `2*cp_size`).
    Returns `(flat, segment, position)`, each `[sum(seq_lengths) / cp_size]` long: the index into
    the global pack, the sequence each local token belongs to, and its position in that sequence.
    """
    flat, segment, position = [], [], []
    start = 0
    for i, n in enumerate(seq_lengths):
        pos = chunk_index(int(n), cp_size, cp_rank)
        flat.append(pos + start)
        position.append(pos)
        segment.append(torch.full_like(pos, i))
        start += int(n)
    if not flat:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty
    return torch.cat(flat), torch.cat(segment), torch.cat(position)


def cp_group_info(group: Optional["dist.ProcessGroup"]) -> tuple[int, int]:
    """(size, rank) of a CP group; (1, 0) for None."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _GatherAlongSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward: sum the full gradient over ranks, keep our slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size, rank = cp_group_info(group)
        ctx.rank, ctx.local = rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.local
        return grad[start:start + ctx.local], None


def gather_along_sequence(x: torch.Tensor, group: "dist.ProcessGroup") -> torch.Tensor:
    """`[s_local, ...]` on every CP rank -> `[cp * s_local, ...]` in rank order (differentiable).

    The backward is a reduce-scatter written as all-reduce + slice: this runs only in the CPU
    attention (gloo has no reduce_scatter), where the extra traffic does not matter.
    """
    if cp_group_info(group)[0] == 1:
        return x
    return _GatherAlongSequence.apply(x, group)
