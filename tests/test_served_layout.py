"""`convert.served_layout`: SGLang's layout of the weights and its tensor hashes, as `/weights_checker`
reports them. The live replies of both engines are compared in `tests/test_server_contract.py`; here the
layout's rules one by one, and the torch port of SGLang's GPU hash against SGLang's own Triton kernel
(run by Triton's CPU interpreter in `.venv-sglang`: no GPU has run either)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from contract_helpers import ROOT, SGLANG_PYTHON
from megatron_bapo.convert.served_layout import (ServedLayout, cpu_tensor_hash, gpu_tensor_hash, served_dtype,
                                                 served_tensors)

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False, "dtype": "bfloat16"}


def test_fused_tensors_come_out_once_all_their_parts_arrived_in_any_order_and_bucketing():
    layout = ServedLayout(QWEN2, torch.float32)
    p = "model.layers.3."
    q, k, v = (torch.full((n, 4), float(i)) for i, n in ((1, 8), (2, 2), (3, 2)))
    assert layout.add(p + "self_attn.v_proj.weight", v) == []
    assert layout.add(p + "self_attn.q_proj.weight", q) == [] and layout.pending() == [p + "self_attn.qkv_proj.weight"]
    v.fill_(9)  # a sender reusing its buffer after the call: the waiting part was copied
    ((name, fused),) = layout.add(p + "self_attn.k_proj.weight", k)
    assert name == p + "self_attn.qkv_proj.weight" and torch.equal(fused, torch.cat([q, k, torch.full((2, 4), 3.0)]))
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    out = dict(served_tensors([(p + "mlp.up_proj.weight", up), (p + "mlp.gate_proj.weight", gate),
                               (p + "self_attn.o_proj.weight", q)], QWEN2, torch.bfloat16))
    assert list(out) == [p + "mlp.gate_up_proj.weight", p + "self_attn.o_proj.weight"]
    assert torch.equal(out[p + "mlp.gate_up_proj.weight"], torch.cat([gate, up]).to(torch.bfloat16))
    with pytest.raises(ValueError, match="incomplete fused tensors"):
        list(served_tensors([(p + "mlp.up_proj.weight", up)], QWEN2, torch.float32))


def test_vocabulary_rows_are_zero_padded_to_64_and_a_tied_head_is_not_served():
    emb = torch.randn(100, 8)
    ((_, padded),) = ServedLayout(QWEN2, torch.float32).add("model.embed_tokens.weight", emb)
    assert padded.shape == (128, 8) and torch.equal(padded[:100], emb) and not padded[100:].any()
    ((_, head),) = ServedLayout(QWEN2, torch.float32).add("lm_head.weight", emb[:64])
    assert head.shape == (64, 8)
    assert ServedLayout({**QWEN2, "tie_word_embeddings": True}, torch.float32).add("lm_head.weight", emb) == []


def test_what_is_not_covered_is_refused_and_the_server_dtype_follows_sglangs_auto_rule():
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM.*not implemented"):
        ServedLayout({"architectures": ["Qwen3MoeForCausalLM"]}, torch.float32)
    with pytest.raises(ValueError, match="at TP 2 is not implemented"):
        ServedLayout(QWEN2, torch.float32, tp_size=2)
    assert served_dtype("auto", QWEN2) == torch.bfloat16 and served_dtype("float32", QWEN2) == torch.float32
    assert served_dtype("auto", {"dtype": "float32", "model_type": "qwen2"}) == torch.float16  # SGLang's choice
    assert served_dtype("auto", {"torch_dtype": "float32", "model_type": "gemma2"}) == torch.bfloat16


def test_the_cpu_hash_is_the_first_8_bytes_of_a_sha256_of_the_raw_bytes():
    import hashlib

    t = torch.arange(10, dtype=torch.bfloat16)
    assert cpu_tensor_hash(t) == int.from_bytes(hashlib.sha256(t.view(torch.int16).numpy().tobytes()).digest()[:8], "big")
    assert cpu_tensor_hash(t[::2]) == cpu_tensor_hash(t[::2].contiguous())


KERNEL = r"""
import importlib.util, json, os, sys
import torch
import triton
root = os.path.dirname(importlib.util.find_spec("sglang").origin)
spec = importlib.util.spec_from_file_location("gth", os.path.join(root, "kernels/ops/memory/gpu_tensor_hash.py"))
gth = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gth)  # the module itself: its kernels, constants and final mix, nothing copied

def kernel_hash(t, seed=0x243F6A88, tile=8192, block=256, chunk=1024):
    # gpu_tensor_hash's host code (it asserts a CUDA tensor) with CPU tensors for the interpreter
    b = t.contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, torch.zeros(4 - b.numel() % 4, dtype=torch.uint8)])
    words = b.view(torch.int32)
    n = words.numel()
    partials = torch.empty(triton.cdiv(n, tile), dtype=torch.int64)
    gth.hash_tiles32_kernel_blocked[(partials.numel(),)](
        words, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=gth.FMIX32_C1, FM_C2=gth.FMIX32_C2, POS_A=gth.POS_C1, POS_B=gth.POS_C2, TILE=tile, BLOCK=block,
        USE_CG=False)
    cur = partials
    while cur.numel() > 1:
        nxt = torch.empty(triton.cdiv(cur.numel(), chunk), dtype=torch.int64)
        gth.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=chunk)
        cur = nxt
    return gth._final_splitmix64(int(cur.item()) & ((1 << 64) - 1))

out = []
for path in sys.argv[1:]:
    out.append(f"{kernel_hash(torch.load(path)):016x}")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_gpu_hash_port_equals_sglangs_triton_kernel_run_by_the_interpreter(tmp_path):
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run bash tools/install.sh --with-sglang (tools/run_tests.sh does)")
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(3, generator=g), torch.randn(5, generator=g).to(torch.bfloat16),  # under a word, odd bytes
             torch.randn(8192, generator=g), torch.randn(8193, generator=g),  # one tile, one word past it
             torch.randn(3, 7001, generator=g).to(torch.bfloat16), torch.randn(40000, generator=g)]
    paths = []
    for i, t in enumerate(cases):
        paths.append(str(tmp_path / f"{i}.pt"))
        torch.save(t, paths[-1])
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([str(SGLANG_PYTHON), "-c", KERNEL, *paths], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    kernel = json.loads(out.stdout.strip().splitlines()[-1])
    assert kernel == [f"{gpu_tensor_hash(t, chunk_words=16384):016x}" for t in cases]
