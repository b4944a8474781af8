"""A left-padded batch KV cache that requests can join and leave between decode steps.

Why not one `DynamicCache` per request: a decode step must run all active requests in one forward
pass. Rows are aligned on the right (the newest token of every row sits in the last column), older
columns are padding for shorter rows and masked out by the attention mask; each row carries its own
`position_ids`, so a row's numbers do not depend on what else is in the batch. Joining pads one side
to the longer length; leaving selects rows and drops columns that became padding for every row.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import DynamicCache


class BatchKV:
    """Per-layer keys/values [batch, kv_heads, T, head_dim] plus the attention mask [batch, T]."""

    def __init__(self) -> None:
        self.layers: Optional[list] = None
        self.mask: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def clear(self) -> None:
        self.layers, self.mask = None, None

    @staticmethod
    def from_cache(cache: DynamicCache) -> list:
        return [(layer.keys, layer.values) for layer in cache.layers]

    def append(self, layers: Sequence, mask: torch.Tensor) -> None:
        """Add rows: `layers` = per-layer (k, v) with batch dim b, `mask` [b, L] (1 = real token)."""
        if self.mask is None:
            self.layers, self.mask = [(k, v) for k, v in layers], mask
            return
        t_old, t_new = self.length, int(mask.shape[1])
        t = max(t_old, t_new)
        old_layers, old_mask = self._pad_left(self.layers, self.mask, t - t_old)
        new_layers, new_mask = self._pad_left(layers, mask, t - t_new)
        self.layers = [(torch.cat([ko, kn]), torch.cat([vo, vn])) for (ko, vo), (kn, vn) in zip(old_layers, new_layers)]
        self.mask = torch.cat([old_mask, new_mask])

    @staticmethod
    def _pad_left(layers: Sequence, mask: torch.Tensor, pad: int):
        if pad == 0:
            return list(layers), mask
        out = []
        for k, v in layers:
            zk = k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3])
            zv = v.new_zeros(v.shape[0], v.shape[1], pad, v.shape[3])
            out.append((torch.cat([zk, k], dim=2), torch.cat([zv, v], dim=2)))
        return out, torch.cat([mask.new_zeros(mask.shape[0], pad), mask], dim=1)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order) and drop columns that are padding in every kept row."""
        if not rows:
            self.clear()
            return
        if len(rows) == self.batch_size and list(rows) == list(range(self.batch_size)):
            return
        idx = torch.tensor(list(rows), dtype=torch.long)
        mask = self.mask.index_select(0, idx)
        real = mask.sum(dim=1)
        start = int(self.length - int(real.max()))
        self.mask = mask[:, start:]
        self.layers = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
                       for k, v in self.layers]

    def to_cache(self, config) -> DynamicCache:
        return DynamicCache(ddp_cache_data=self.layers, config=config)

    def advance(self, cache: DynamicCache) -> None:
        """After a decode step on `to_cache()`: take the grown tensors and extend the mask by one column."""
        self.layers = self.from_cache(cache)
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
