"""A pure-torch stand-in for `sgl_kernel`, so SGLang's own server runs on a CPU without its kernels.

With `SGLANG_USE_CPU_ENGINE=1` SGLang imports CPU kernels from `sgl_kernel` at module level. PyPI has
only the CUDA build (`sglang-kernel`); the CPU build (`sglang-kernel-cpu`, AMX C++) is neither on
PyPI nor buildable from a source distribution there. This module is put on the SGLang server venv's
path by `tools/install.sh --with-sglang` (a `.pth` file pointing at `sglang_cpu/site/`).

It registers no `torch.ops.sgl_kernel` operator, so SGLang's `cpu_has_amx_support()` is False and
every layer takes SGLang's torch-native path (attention `torch_native`, sampling `pytorch`). What a
dense model (Qwen2/Qwen3/Llama, Qwen3-MoE) still calls from here on that path is implemented below
in pure torch, each function tested against its definition (`tests/test_sglang_cpu.py`). Every other
name imports (SGLang imports many at module level and uses them only on other paths), but calling it
raises `NotImplementedError` naming the function, so a new code path fails loudly instead of
computing something else.
"""

from __future__ import annotations

import torch

IMPLEMENTED = ("assign_req_to_token_pool_cpu",)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Write newly allocated KV slots into the request-to-token table, in place.

    For each request i (in order), `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`
    receives the next `end_offset[i] - start_offset[i]` entries of `out_cache_loc` (request i's slots
    follow those of requests 0..i-1). The CPU twin of SGLang's Triton kernel
    `assign_req_to_token_pool` (`srt/mem_cache/allocation.py`); `pool_len` is `req_to_token.shape[1]`.
    """
    lengths = (end_offset - start_offset).to(torch.long)
    if lengths.numel() == 0:
        return
    if bool((lengths < 0).any()) or bool((end_offset > pool_len).any()):
        raise ValueError(f"assign_req_to_token_pool_cpu: need 0 <= start <= end <= pool_len={pool_len}, "
                         f"got start {start_offset.tolist()} end {end_offset.tolist()}")
    total = int(lengths.sum())
    if total > out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {total} slots to write but out_cache_loc has "
                         f"{out_cache_loc.numel()}")
    rows = torch.repeat_interleave(req_pool_indices.to(torch.long), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # where request i's slots start in out_cache_loc
    within = torch.arange(total, dtype=torch.long) - torch.repeat_interleave(first, lengths)
    cols = torch.repeat_interleave(start_offset.to(torch.long), lengths) + within
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


class NotOnThisPath:
    """A name SGLang imports from `sgl_kernel` but this stand-in does not implement."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.__name__} was called, but megatron_bapo's pure-torch sgl_kernel stand-in "
            f"(sglang_cpu/site/sgl_kernel) implements only {', '.join(IMPLEMENTED)}: SGLang took a code path "
            f"that needs its compiled kernels (sglang-kernel-cpu). Serve a model and flags on SGLang's "
            f"torch-native CPU path (see sglang_cpu/README.md), or install SGLang's own kernels")

    def __repr__(self) -> str:
        return f"<sgl_kernel.{self.__name__}: not implemented by the CPU stand-in>"


def __getattr__(name: str):
    if name.startswith("_"):  # introspection (__version__, __wrapped__, ...) must see a plain miss
        raise AttributeError(f"module 'sgl_kernel' has no attribute {name!r}")
    return NotOnThisPath(name)
