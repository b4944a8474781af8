"""Micro-batch tensors as the model sees them: padded or packed (THD), sliced for context parallel.

The actor's batch is ALIGNED TO THE TOKEN (`[b, t]` concerns `input_ids[b, t]`). The model's output
at position t predicts token t+1, so a micro-batch is built PREDICTION-ALIGNED instead: position t
carries the input token `ids[t]`, its label `ids[t+1]`, and the label's loss mask, behavior
log-prob, advantage, aggregation weight and version lag, plus the label's coordinates `(row, col)` in the
global batch (-1 where position t predicts nothing: the last real token and padding). The shift
happens on the full sequence BEFORE any context-parallel slicing, because with CP a chunk's last
token predicts the first token of a chunk that another rank may hold.

Two layouts (`MicroBatchLayout.packed`):
- padded: `[rows, S]`, right padding to the longest sequence rounded up to what CP/SP need
  (`2*cp` chunks per row; with sequence parallel each rank's `S/cp` split over TP);
- packed (THD): `[1, T]`, the sequences one after another without padding between them (each
  rounded up to a multiple of `2*cp` with CP), `cu_seqlens` marking their boundaries, and a
  trailing filler segment when sequence parallel needs T/cp divisible by TP. Attention then stays
  within a sequence (`PackedSeqParams`, TE's THD kernels on GPU, `models.cpu_attention` on CPU)
  and positions restart at 0 for every sequence, as the rollout server saw them.
With CP each rank keeps its load-balanced chunks of every row or packed sequence
(`models.context_parallel`). Pure torch: no megatron import, so it is tested in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_bapo.models.context_parallel import chunk_index, packed_index

POSITION_KEYS = ("loss_mask", "behavior_logprobs", "advantages", "weights", "lag")
"""Per-token tensors that travel with their token (moved to the position that predicts it); `lag` is
the token's version lag (policy versions between its sampler and the trained weights)."""


@dataclass(frozen=True)
class MicroBatchLayout:
    """How micro-batches are shaped for the model on this rank."""

    packed: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1
    """Tensor-parallel size when sequence parallelism is on (each rank's tokens split over TP), else 1."""

    @property
    def seq_multiple(self) -> int:
        """Every (packed) sequence's length is a multiple of this: 2*cp chunks with CP."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    @property
    def row_multiple(self) -> int:
        """Padded rows: S is a multiple of this (2*cp chunks, and S/cp divisible by TP under SP)."""
        return math.lcm(self.seq_multiple, self.cp_size * self.sp_size)

    def padded_length(self, longest: int) -> int:
        """Row length S for a padded micro-batch whose longest sequence has `longest` tokens."""
        return _round_up(max(longest, 2), self.row_multiple)

    def packed_lengths(self, lengths: Sequence[int]) -> list[int]:
        """Global slot lengths of a pack: each sequence rounded up to `seq_multiple`, plus a filler
        slot (when needed) so that this rank's token count divides by the SP size."""
        slots = [_round_up(max(int(n), 1), self.seq_multiple) for n in lengths]
        local = sum(slots) // self.cp_size
        extra = 0
        step = 2 if self.cp_size > 1 else 1  # a filler slot of cp*x tokens needs x even under CP
        while (local + extra) % self.sp_size or extra % step:
            extra += 1
        if extra:
            slots.append(extra * self.cp_size)
        return slots

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens the model processes (over all CP ranks) for a micro-batch of these sequences."""
        if not lengths:
            return 0
        if self.packed:
            return sum(self.packed_lengths(lengths))
        return len(lengths) * self.padded_length(max(lengths))


def _round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def _shifted_rows(data: dict[str, torch.Tensor], rows: list[int], width: int) -> dict[str, torch.Tensor]:
    """`[len(rows), width]` prediction-aligned tensors of the given rows (zero / -1 beyond the data)."""
    index = torch.tensor(rows, dtype=torch.long)
    ids = data["input_ids"].index_select(0, index)
    lengths = data["attention_mask"].index_select(0, index).sum(-1)

    def fit(x: torch.Tensor, shift: int, fill) -> torch.Tensor:
        x = x[:, shift:shift + width]
        if x.shape[1] < width:
            x = torch.cat([x, x.new_full((x.shape[0], width - x.shape[1]), fill)], dim=1)
        return x

    cols = torch.arange(width).unsqueeze(0)
    valid = cols + 1 < lengths.unsqueeze(1)  # position t predicts token t+1 of this sequence
    out = {
        "input_ids": torch.where(cols < lengths.unsqueeze(1), fit(ids, 0, 0), 0),
        "labels": torch.where(valid, fit(ids, 1, 0), 0),
        "row": torch.where(valid, index.unsqueeze(1), torch.full_like(valid, -1, dtype=torch.long)),
        "col": torch.where(valid, cols + 1, torch.full_like(valid, -1, dtype=torch.long)),
    }
    for key in POSITION_KEYS:
        out[key] = torch.where(valid, fit(data[key].index_select(0, index), 1, 0.0), 0.0)
    return out


def build_microbatch(data: dict[str, torch.Tensor], rows: list[int], layout: MicroBatchLayout) -> dict:
    """This CP rank's micro-batch of `rows` of the token-aligned mini-batch `data`.

    `data` holds `[B, T]` input_ids, attention_mask and every `POSITION_KEYS` tensor (token-aligned).
    Returns a dict of `[b, s]` tensors (`b = 1` when packed): input_ids, position_ids, labels,
    row, col, and the `POSITION_KEYS`; packed micro-batches add `cu_seqlens` (int32, global slot
    boundaries) and `max_seqlen`.
    """
    lengths = [int(n) for n in data["attention_mask"][rows].sum(-1)]
    if not layout.packed:
        width = layout.padded_length(max(lengths))
        mb = _shifted_rows(data, rows, width)
        mb["position_ids"] = torch.arange(width).unsqueeze(0).expand(len(rows), -1)
        keep = chunk_index(width, layout.cp_size, layout.cp_rank)
        return {k: v.index_select(1, keep).contiguous() for k, v in mb.items()}
    slots = layout.packed_lengths(lengths)
    # Gather this rank's tokens straight from the batch: token j of the pack sits at `position` of
    # slot `segment` (a row of `rows`, or the trailing filler slot, which predicts nothing).
    _, segment, position = packed_index(slots, layout.cp_size, layout.cp_rank)
    num_rows, width = len(rows), data["input_ids"].shape[1]
    real = segment < num_rows
    seg = segment.clamp(max=num_rows - 1)
    row = torch.tensor(rows, dtype=torch.long)[seg]
    seq_len = torch.tensor(lengths, dtype=torch.long)[seg]
    is_token = real & (position < seq_len)
    valid = real & (position + 1 < seq_len)  # position t predicts token t+1 of its sequence
    here, nxt = position.clamp(max=width - 1), (position + 1).clamp(max=width - 1)
    mb = {
        "input_ids": torch.where(is_token, data["input_ids"][row, here], 0),
        "labels": torch.where(valid, data["input_ids"][row, nxt], 0),
        "row": torch.where(valid, row, -1),
        "col": torch.where(valid, position + 1, -1),
        "position_ids": position,
    }
    for key in POSITION_KEYS:
        mb[key] = torch.where(valid, data[key][row, nxt], 0.0)
    mb = {k: v.unsqueeze(0).contiguous() for k, v in mb.items()}
    cu = torch.zeros(len(slots) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(slots, dtype=torch.int32).cumsum(0)
    mb["cu_seqlens"] = cu
    mb["max_seqlen"] = max(slots)
    return mb


def pad_packed_microbatch(mb: dict, local_length: int, layout: MicroBatchLayout) -> dict:
    """A packed micro-batch extended by a filler slot to `local_length` tokens on this rank.

    Interleaved pipeline schedules exchange one fixed tensor shape, so every packed micro-batch of a
    pass is padded to the longest. The filler slot predicts nothing and attends only to itself.
    """
    extra = local_length - mb["input_ids"].shape[1]
    if extra < 0:
        raise ValueError(f"pad_packed_microbatch: micro-batch has {mb['input_ids'].shape[1]} > {local_length} tokens")
    if extra == 0:
        return mb
    slot = extra * layout.cp_size
    _, _, position = packed_index([slot], layout.cp_size, layout.cp_rank)
    out = {}
    for key, value in mb.items():
        if key in ("cu_seqlens", "max_seqlen"):
            continue
        fill = -1 if key in ("row", "col") else 0
        out[key] = torch.cat([value, value.new_full((1, extra), fill)], dim=1)
    out["position_ids"][0, -extra:] = position
    out["cu_seqlens"] = torch.cat([mb["cu_seqlens"], mb["cu_seqlens"][-1:] + slot])
    out["max_seqlen"] = max(int(mb["max_seqlen"]), slot)
    return out


def local_position_ids(mb: dict, layout: MicroBatchLayout) -> torch.Tensor:
    """The `position_ids` of a micro-batch rebuilt from its shape (and `cu_seqlens` when packed), so
    they need not travel with it: positions restart per packed slot, chunked per CP rank."""
    rows, width = mb["shape"]
    if "cu_seqlens" in mb:
        slots = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
        return packed_index(slots, layout.cp_size, layout.cp_rank)[2].unsqueeze(0)
    return chunk_index(width * layout.cp_size, layout.cp_size, layout.cp_rank).expand(rows, -1)


def empty_like_microbatch(mb: dict) -> dict:
    """A copy of `mb` that trains nothing (a filler for ranks with fewer micro-batches)."""
    out = dict(mb)
    for key in POSITION_KEYS:
        out[key] = torch.zeros_like(mb[key])
    out["row"] = torch.full_like(mb["row"], -1)
    out["col"] = torch.full_like(mb["col"], -1)
    return out
