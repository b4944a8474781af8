"""Core attention on `scaled_dot_product_attention`: the CPU layer spec's replacement for TE attention.

megatron-core's local `DotProductAttention` allocates its score buffer on CUDA, so without CUDA the
core attention is this module (signature of megatron's DotProductAttention). It covers the three
layouts the actor feeds the model:

- padded (`[s, b, heads, dim]`, right padding): plain causal SDPA; padding comes after every real
  token, so it needs no mask;
- packed (THD, `packed_seq_params.qkv_format == "thd"`, `[t, heads, dim]`): block-diagonal causal,
  every sequence of the pack attends only to its own earlier tokens. Sequences of similar length
  (within 2x) are laid out as one `[num_seqs, longest]` batch per SDPA call, and the outputs are put
  back in pack order;
- context parallel (either layout, CP size > 1): this rank holds its load-balanced chunks
  (`models.context_parallel`); keys and values are all-gathered over the CP group (gradients
  reduce-scattered back) and the mask is causal by GLOBAL position, so `cp=2` equals `cp=1`.

On GPUs Transformer Engine's attention does the same work with fused kernels and ring/all-to-all
CP exchanges; this module exists so the data path (chunking, RoPE slicing, labels, reductions) is
tested on CPU against single-process references.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_bapo.models.context_parallel import chunk_index, cp_group_info, gather_along_sequence, packed_index


def _cp_group(config, pg_collection):
    if config.context_parallel_size == 1:
        return None
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
    return group


def _sdpa_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class SdpaAttention(MegatronModule):
        """Causal core attention over SDPA: padded, packed (THD) and context-parallel inputs.

        Inputs are megatron's layout: query `[sq, b, np, hn]`, key/value `[sk, b, ng, hn]` (GQA: ng
        divides np), or `[t, np, hn]` / `[t, ng, hn]` with THD packing; returns `[sq, b, np * hn]`
        (THD: `[t, np * hn]`).
        """

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                     cp_comm_type: Optional[str] = None, pg_collection=None) -> None:
            super().__init__(config=config)
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
            self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
            self.attn_mask_type = attn_mask_type
            self.cp_group = _cp_group(config, pg_collection)

        # -------------------------------------------------------------- one SDPA call
        def _sdpa(self, q, k, v, mask: Optional[torch.Tensor]):
            """q `[..., np, sq, hn]`, k/v `[..., ng, sk, hn]`; mask None means causal."""
            kwargs = dict(scale=self.softmax_scale, enable_gqa=k.shape[-3] != q.shape[-3])
            if mask is None:
                kwargs["is_causal"] = True
            else:
                kwargs["attn_mask"] = mask
            dropout = self.dropout_p if self.training else 0.0
            if not dropout:
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **kwargs)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_bias is not None:
                raise ValueError("SdpaAttention: attention bias needs the Transformer Engine spec")
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._packed(query, key, value, packed_seq_params)
            if packed_seq_params is not None:
                raise ValueError(f"SdpaAttention: qkv_format {packed_seq_params.qkv_format!r} is not supported")
            sq, b, nh, hn = query.shape
            q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
            k, v, mask = key, value, None
            size, rank = cp_group_info(self.cp_group)
            if size > 1:
                # Local rows are chunks (rank, 2*cp-1-rank) of a length-(sq*cp) row; keys from all ranks.
                k = gather_along_sequence(key, self.cp_group)
                v = gather_along_sequence(value, self.cp_group)
                full = sq * size
                q_pos = chunk_index(full, size, rank)
                k_pos = torch.cat([chunk_index(full, size, r) for r in range(size)])
                mask = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).to(q.device)
            out = self._sdpa(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), mask)
            return out.permute(2, 0, 1, 3).reshape(sq, b, nh * hn)

        # -------------------------------------------------------------- packed (THD)
        def _packed(self, query, key, value, params):
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            lengths = (cu[1:] - cu[:-1]).tolist()
            size, rank = cp_group_info(self.cp_group)
            t, nh, hn = query.shape
            dev = query.device
            local = [n // size for n in lengths]
            starts = [0]
            for n in local[:-1]:
                starts.append(starts[-1] + n)
            k_all = v_all = order = q_pos_all = None
            if size > 1:
                k_all = gather_along_sequence(key, self.cp_group)
                v_all = gather_along_sequence(value, self.cp_group)
                # Gathered keys in global pack order: sequence i is [cu_i, cu_i + len_i).
                layouts = [packed_index(lengths, size, r) for r in range(size)]
                global_flat = torch.cat([flat for flat, _, _ in layouts]).to(dev)
                order = torch.empty_like(global_flat)
                order[global_flat] = torch.arange(global_flat.numel(), device=dev)
                q_pos_all = layouts[rank][2].to(dev)
            # One SDPA call per length bucket (lengths within 2x of each other): padding a pack to
            # its longest sequence would cost (sequences x longest^2), far more than the pack itself.
            buckets: dict[int, list[int]] = {}
            for i, n in enumerate(local):
                buckets.setdefault(max(n, 1).bit_length(), []).append(i)
            outs, rows = [], []
            for seqs in buckets.values():
                lq = max(local[i] for i in seqs)
                j = torch.arange(lq, device=dev)
                n_local = torch.tensor([local[i] for i in seqs], device=dev)
                q_valid = j.unsqueeze(0) < n_local.unsqueeze(1)  # [n, lq]
                q_index = (torch.tensor([starts[i] for i in seqs], device=dev).unsqueeze(1) + j).clamp(max=t - 1)
                q = query[q_index].permute(0, 2, 1, 3)  # [n, np, lq, hn]
                if size == 1:
                    # Keys are the queries' own tokens: causal within each padded row is exact.
                    k = key[q_index].permute(0, 2, 1, 3)
                    v = value[q_index].permute(0, 2, 1, 3)
                    mask = None
                else:
                    lk = max(lengths[i] for i in seqs)
                    jk = torch.arange(lk, device=dev)
                    n_global = torch.tensor([lengths[i] for i in seqs], device=dev)
                    k_valid = jk.unsqueeze(0) < n_global.unsqueeze(1)  # [n, lk]
                    first = cu[:-1].to(dev).long()[torch.tensor(seqs, device=dev)]
                    k_index = order[(first.unsqueeze(1) + jk).clamp(max=order.numel() - 1)]
                    k = k_all[k_index].permute(0, 2, 1, 3)
                    v = v_all[k_index].permute(0, 2, 1, 3)
                    q_pos = torch.where(q_valid, q_pos_all[q_index], torch.full_like(q_index, lk))  # padding sees all
                    mask = (k_valid.unsqueeze(1) & (jk.view(1, 1, lk) <= q_pos.unsqueeze(2))).unsqueeze(1)
                out = self._sdpa(q, k, v, mask).permute(0, 2, 1, 3).reshape(-1, nh * hn)  # [n * lq, np * hn]
                keep = q_valid.reshape(-1)
                outs.append(out[keep])
                rows.append(q_index.reshape(-1)[keep])
            # Back to pack order.
            perm = torch.empty(t, dtype=torch.long, device=dev)
            perm[torch.cat(rows)] = torch.arange(t, device=dev)
            return torch.cat(outs)[perm]

    return SdpaAttention


_SDPA = None


def sdpa_attention_class():
    """The SDPA core-attention module class (built lazily so importing this file needs no megatron)."""
    global _SDPA
    if _SDPA is None:
        _SDPA = _sdpa_attention_class()
    return _SDPA
