"""Several CPU tensors as one contiguous buffer, for a process boundary.

`torch.multiprocessing` moves each CPU tensor's storage into shared memory and hands the other
process one file descriptor per storage; for a weight bucket of hundreds of tensors, or a batch
cut for 128 ranks, those hand-overs cost more than the data. Packed, they cross as one segment and
come back as views (no copy on the receiving side).
"""

from __future__ import annotations

from typing import Any

import torch


class Packed:
    """CPU tensors in one contiguous uint8 buffer: it crosses the pipe as one shared-memory segment (one
    file descriptor), where separate tensors would cost one descriptor hand-over each (a bucket of
    hundreds of tensors, a shipment for 128 ranks). `extra` rides along (names, coordinates)."""

    ALIGN = 64

    def __init__(self, buffer: torch.Tensor, layout: list[tuple[torch.dtype, tuple[int, ...], int, int]],
                 extra: Any = None) -> None:
        self.buffer, self.layout, self.extra = buffer, layout, extra

    @classmethod
    def of(cls, tensors: list[torch.Tensor], extra: Any = None) -> "Packed":
        layout, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append((t.dtype, tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // cls.ALIGN) * cls.ALIGN  # aligned, so every view keeps its dtype's alignment
        buffer = torch.empty(max(offset, 1), dtype=torch.uint8)
        for t, (_, _, start, nbytes) in zip(tensors, layout):
            if nbytes:
                buffer[start:start + nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        return cls(buffer, layout, extra)

    def tensors(self) -> list[torch.Tensor]:
        """Views into the buffer (no copy), with their dtypes and shapes."""
        return [self.buffer[start:start + nbytes].view(dtype).reshape(shape)
                for dtype, shape, start, nbytes in self.layout]
