"""Batched prefill of several distinct contexts in one forward pass (left padding).

Why: short RL responses (the tiny default asks for ~12 tokens) make prefill a large share of the
work, and one forward per prompt leaves the batch dimension unused. Rows are left-padded to the
longest context, carry their own `position_ids`, and the KV entries at padded positions are zeroed
so that no padding value (finite or not) can leak into later steps, where those columns stay masked.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_bapo.server.kv import BatchKV


def batched_prefill(model, contexts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Forward `contexts` together; returns (next-token logits [b, vocab] fp32, per-layer (k, v)
    [b, heads, L, dim], attention mask [b, L]) with rows right-aligned (left padding)."""
    length = max(len(c) for c in contexts)
    ids = torch.zeros(len(contexts), length, dtype=torch.long)
    mask = torch.zeros(len(contexts), length, dtype=torch.long)
    for i, ctx in enumerate(contexts):
        ids[i, length - len(ctx):] = torch.tensor(list(ctx), dtype=torch.long)
        mask[i, length - len(ctx):] = 1
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    layers = BatchKV.from_cache(out.past_key_values)
    if int(mask.min()) == 0:
        keep = mask[:, None, :, None].to(layers[0][0].dtype)
        layers = [(torch.nan_to_num(k) * keep, torch.nan_to_num(v) * keep) for k, v in layers]
    return out.logits[:, -1].float(), layers, mask


def chunk_by_tokens(contexts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Split indices of `contexts` (sorted by length) into chunks whose padded size <= max_tokens
    (a single longer context gets its own chunk)."""
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(contexts[i])  # sorted ascending: the newest is the longest
        if current and longest * (len(current) + 1) > max_tokens:
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks
