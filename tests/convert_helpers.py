"""Shared helpers for the converter tests: tiny random HF models built with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            num_hidden_layers=2, rms_norm_eps=1e-6)
IDS = torch.tensor([[5, 17, 3, 42, 8, 99, 1, 60, 23, 7, 11, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 50, 51]])
"""Two token rows the logits comparisons run on (ids below every tiny vocabulary)."""

CONFIGS = {
    "qwen2_tied": ("qwen2", dict(BASE, max_position_embeddings=256, vocab_size=100, tie_word_embeddings=True)),
    "qwen2_untied": ("qwen2", dict(BASE, max_position_embeddings=256, vocab_size=130, tie_word_embeddings=False, num_key_value_heads=4)),
    # head_dim 24 != hidden 64 / 4 heads: q is 96 wide, k/v 48 (as Qwen3-32B's 8192-wide q on a 5120 hidden)
    "qwen3_tied": ("qwen3", dict(BASE, max_position_embeddings=256, vocab_size=100, tie_word_embeddings=True, head_dim=24)),
    "qwen3_untied": ("qwen3", dict(BASE, max_position_embeddings=256, vocab_size=130, tie_word_embeddings=False,
                                   head_dim=24, rope_theta=1000000.0)),
    # 8 experts of width 40, top-2 renormalised (as Qwen3-30B-A3B), untied head, head_dim 24 != 64 / 4
    "qwen3_moe": ("qwen3_moe", dict(BASE, max_position_embeddings=256, vocab_size=130, tie_word_embeddings=False,
                                    head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_moe_no_norm": ("qwen3_moe", dict(BASE, max_position_embeddings=256, vocab_size=100, tie_word_embeddings=True,
                                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                            norm_topk_prob=False)),
    "llama": ("llama", dict(BASE, vocab_size=120, max_position_embeddings=16384, tie_word_embeddings=False, rope_theta=500000.0,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}


def make_hf_model(name: str, out_dir: Path, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Write a random tiny HF model (fp32, non-trivial weights incl. biases and norms, q/k norms
    included) to `out_dir`."""
    from megatron_bapo.tiny.checkpoint import ARCHITECTURES

    family, kw = CONFIGS[name]
    cfg_cls, model_cls = ARCHITECTURES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), **kwargs)
    return Path(out_dir)


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def hf_config_dict(hf_dir: Path) -> dict:
    return json.loads((Path(hf_dir) / "config.json").read_text())


def megatron_logits(model, ids: torch.Tensor, vocab_size: int, tp_group=None) -> torch.Tensor:
    """Full-vocab logits [b, s, vocab] of a megatron GPTModel chunk (gathered over TP)."""
    import torch.distributed as dist

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        out = model(ids, pos, None)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, out.contiguous(), group=tp_group)
        out = torch.cat(parts, dim=-1)
    return out[..., :vocab_size].float()


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
