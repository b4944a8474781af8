"""The rollout server's own layout of the weights and its tensor hash: what `/weights_checker` reports.

SGLang 0.5.23's `POST /weights_checker {"action": "checksum"}` hashes every parameter of the model
it serves, per engine rank, under SGLang's own names and in its own layout (`srt/utils/weight_checker.py`).
For the dense Llama-like families (`SERVED_FAMILIES`: Qwen2, Qwen3, Llama) served at TP 1 that is:

| SGLang name | made of (HF names) |
|---|---|
| `model.layers.{i}.self_attn.qkv_proj.weight` (and `.bias`) | rows `[q_proj; k_proj; v_proj]` |
| `model.layers.{i}.mlp.gate_up_proj.weight` | rows `[gate_proj; up_proj]` |
| `model.embed_tokens.weight`, `lm_head.weight` | rows zero-padded to a multiple of 64 (`VocabParallelEmbedding`) |
| `lm_head.weight` | absent with `tie_word_embeddings` (the head is the embedding module) |
| everything else (norms, `o_proj`, `down_proj`, Qwen3's `q_norm` / `k_norm`) | the HF tensor as is |

each in the dtype the server computes in (`served_dtype`), and no buffers (SGLang skips the rotary
caches). Qwen3-MoE (fused experts, `w13_weight` / `w2_weight`) and servers at TP > 1 (every rank a
shard, kv heads replicated past the kv-head count) are not covered: `ServedLayout` refuses them.

The hash is `sglang.srt.managers.mm_utils.tensor_hash` of the parameter on the server's device:
on a CPU the first 8 bytes of a sha256 of the raw bytes (`cpu_tensor_hash`), on a GPU a Triton kernel
(per-8192-word tiles of mixed 32-bit words, summed, `gpu_tensor_hash` below is its torch port, run
against SGLang's kernel in Triton's CPU interpreter, never on a GPU here). `/weights_checker` prints
each as 16 hex digits and adds a sha256 over the sorted (name, hash) pairs (`overall_checksum`).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Iterator, Optional

import torch

SERVED_FAMILIES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
VOCAB_PADDING = 64
"""SGLang's `DEFAULT_VOCAB_PADDING_SIZE`: embedding and head rows are padded to a multiple of it."""
PADDED = ("model.embed_tokens.weight", "lm_head.weight")
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_PART = re.compile(r"^(.*\.)(self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj)\.(weight|bias)$")
_PART_OF = {part: (fused, parts.index(part), len(parts)) for fused, parts in FUSED.items() for part in parts}
_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


def _as_dict(hf_config: Any) -> dict:
    return dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()


def served_dtype(server_dtype: str, hf_config: Any) -> torch.dtype:
    """The dtype a server launched with `--dtype server_dtype` computes in, by SGLang's rule
    (`model_config._get_and_verify_dtype`): "auto" is the checkpoint's dtype, except float32, which
    SGLang serves in float16 (bfloat16 for Gemma)."""
    name = str(server_dtype).lower()
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown server dtype {server_dtype!r}; expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[name]
    cfg = _as_dict(hf_config)
    config_dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    config_dtype = _DTYPES.get(str(config_dtype).replace("torch.", ""), torch.float32)
    if config_dtype == torch.float32:
        return torch.bfloat16 if str(cfg.get("model_type", "")).startswith("gemma") else torch.float16
    return config_dtype


class ServedLayout:
    """HF-named tensors -> (SGLang name, tensor as the server holds it) for one model at TP 1.

    `add` takes tensors in any order and split over any number of calls (a weight bucket may end
    between q_proj and k_proj); a fused tensor comes out once all its parts arrived (parts are copied
    while they wait: a sender may reuse its buffers after the call)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, tp_size: int = 1) -> None:
        cfg = _as_dict(hf_config)
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in SERVED_FAMILIES:
            raise ValueError(f"the server layout of {arch!r} is not implemented (covered: {', '.join(SERVED_FAMILIES)})")
        if int(tp_size) != 1:
            raise ValueError(f"the server layout at TP {tp_size} is not implemented (each rank holds a shard; "
                             f"covered: servers at TP 1)")
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.dtype = dtype
        self._pending: dict[str, list[Optional[torch.Tensor]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The server tensors `name` completes ([] while a fused tensor still waits for parts)."""
        if self.tied and name == "lm_head.weight":
            return []  # a tied checkpoint may still carry the head: SGLang's is the embedding
        m = _PART.match(name)
        if m is None:
            t = tensor.detach().to(self.dtype)
            if name in PADDED:
                t = _pad_rows(t, VOCAB_PADDING)
            return [(name, t.contiguous())]
        prefix, part, suffix = m.groups()
        fused, index, count = _PART_OF[part]
        key = f"{prefix}{fused}.{suffix}"
        parts = self._pending.setdefault(key, [None] * count)
        parts[index] = tensor.detach().to(self.dtype, copy=True)
        if any(p is None for p in parts):
            return []
        del self._pending[key]
        return [(key, torch.cat(parts, dim=0))]

    def pending(self) -> list[str]:
        """Fused tensors still missing parts (none once every tensor was added)."""
        return sorted(self._pending)


def served_tensors(named: Iterable[tuple[str, torch.Tensor]], hf_config: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (SGLang name, tensor) of a whole HF state (e.g. a checkpoint's tensors, a model's parameters)."""
    layout = ServedLayout(hf_config, dtype)
    for name, tensor in named:
        yield from layout.add(name, tensor)
    if layout.pending():
        raise ValueError(f"incomplete fused tensors (a part is missing): {layout.pending()[:5]}")


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    rows = -(-t.shape[0] // multiple) * multiple
    if rows == t.shape[0]:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


# ---------------------------------------------------------------------- the hashes
def cpu_tensor_hash(t: torch.Tensor) -> int:
    """SGLang's CPU `tensor_hash`: the first 8 bytes (big-endian) of a sha256 of the raw bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return int.from_bytes(h.digest()[:8], "big")


_M32 = 0xFFFFFFFF
_TILE = 8192  # gpu_tensor_hash's tile_words
_FM_C1, _FM_C2, _POS_A, _POS_B = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2D, 0x165667B1
_SEED = 0x243F6A88


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without overflowing int64 (16-bit halves)."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _FM_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FM_C2)
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & m
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


@torch.no_grad()
def gpu_tensor_hash(t: torch.Tensor, *, chunk_words: int = 1 << 22) -> int:
    """SGLang's CUDA `tensor_hash` (`sglang/kernels/ops/memory/gpu_tensor_hash.py`, default seed and
    tiles) in plain torch, on `t`'s own device: the bytes as little-endian 32-bit words (zero-padded),
    each word mixed with its index by two murmur3 finalisers, summed per tile of 8192 words, each
    tile's pair finalised with the byte count, the 64-bit tile values summed, then splitmix64."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = data.numel()
    if nbytes == 0:
        return 0
    if nbytes % 4:
        data = torch.cat([data, torch.zeros(4 - nbytes % 4, dtype=torch.uint8, device=data.device)])
    words = data.view(torch.int32)
    n = words.numel()
    seed1, seed2 = _SEED & _M32, ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    size = (n * 4) & _M32
    step = max(_TILE, chunk_words // _TILE * _TILE)
    sum1 = sum2 = 0
    for start in range(0, n, step):
        v = words[start:start + step].to(torch.int64) & _M32
        idx = torch.arange(start, start + v.numel(), dtype=torch.int64, device=v.device) & _M32
        k1 = _fmix32(v ^ (((_mul32(idx, _POS_A) + seed1) & _M32) ^ _rotl32(idx, 15)))
        k2 = _fmix32(v ^ (((_mul32(idx, _POS_B) + seed2) & _M32) ^ _rotl32(idx, 13)))
        tiles = -(-v.numel() // _TILE)
        pad = tiles * _TILE - v.numel()
        if pad:
            k1, k2 = (torch.cat([k, torch.zeros(pad, dtype=torch.int64, device=k.device)]) for k in (k1, k2))
        h1 = _fmix32((k1.view(tiles, _TILE).sum(1) & _M32) ^ size)
        h2 = _fmix32((k2.view(tiles, _TILE).sum(1) & _M32) ^ size)
        sum1 += int(h1.sum())
        sum2 += int(h2.sum())
    return _splitmix64((sum1 << 32) + sum2)


def tensor_hash(t: torch.Tensor, device_type: str) -> str:
    """`/weights_checker`'s hash of `t` as a server on `device_type` ("cpu" or "cuda") computes it, as
    16 hex digits."""
    if device_type == "cpu":
        return f"{cpu_tensor_hash(t):016x}"
    if device_type == "cuda":
        return f"{gpu_tensor_hash(t):016x}"
    raise ValueError(f"no tensor hash for a server on {device_type!r} (cpu or cuda)")


def overall_checksum(checksums: dict[str, str]) -> str:
    """`per_gpu_checksum`: a sha256 over the (name, hash) pairs in name order."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()
