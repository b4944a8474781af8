"""A tiny random HF checkpoint (Qwen2 by default, Qwen3, Qwen3-MoE or Llama) with the char-level tokenizer.

Used by tests (`tests/conftest.py::tiny_hf_dir`), by the built-in server, by conversion round trips and
as the starting point of the tiny default's SFT warm start. Everything is built locally: no Hub access.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, tuple[type, type]] = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}
"""`architecture` override -> (HF config class, HF model class)."""

ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(head_dim=32),
    "qwen3_moe": dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                      tie_word_embeddings=False),
}
"""Per-architecture defaults on top of `DEFAULT_MODEL_KWARGS`. Qwen3's `head_dim` is its own field and
differs from hidden_size / num_attention_heads in the real models (32B: 64 heads x 128 on a 5120
hidden size), so the tiny Qwen3 has 4 heads x 32 on 64: the case conversion and the builder must get right.
The tiny Qwen3-MoE has 8 experts of width 32, 2 per token, top-k probabilities renormalised (as
Qwen3-30B-A3B: 128 experts of width 768, 8 per token), a mixture of experts in every layer, and an untied
head like every real Qwen3-MoE (SGLang's Qwen3-MoE ignores `tie_word_embeddings`: a tied checkpoint
without `lm_head.weight` would be served with a zero head)."""

DEFAULT_MODEL_KWARGS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    hidden_act="silu",
)
"""Defaults: GQA (4 query heads over 2 KV heads, head_dim 16) and tied embeddings, the two features
of real Qwen2 checkpoints that conversion and the Megatron builder must get right."""

ROPE_THETA = 10000.0


def build_tiny_model(tokenizer, *, seed: int = 0, architecture: str = "qwen2", **overrides: Any) -> torch.nn.Module:
    """A randomly initialised fp32 causal LM sized by `DEFAULT_MODEL_KWARGS` updated with `overrides`.

    `vocab_size` defaults to `len(tokenizer)`; eos/pad/bos ids come from the tokenizer.
    Overrides are HF config fields (e.g. `hidden_size=128, num_hidden_layers=4`).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}")
    config_cls, model_cls = ARCHITECTURES[architecture]
    kwargs = dict(DEFAULT_MODEL_KWARGS, **ARCHITECTURE_DEFAULTS.get(architecture, {}))
    kwargs.update(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    kwargs.update(overrides)
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size={kwargs['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = config_cls(**kwargs)
    config.dtype = torch.float32
    # Seed only our own generator state: save, seed, build, restore, so callers' RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        do_sample=False,
    )
    return model.to(torch.float32).eval()


def make_tiny_hf_checkpoint(out_dir, *, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """Write a random tiny model + char-level tokenizer to `out_dir` (created) and return its path.

    The directory loads offline with `AutoModelForCausalLM.from_pretrained` /
    `AutoTokenizer.from_pretrained`: config.json, generation_config.json, model.safetensors (fp32),
    tokenizer files and the chat template. Same seed and overrides -> identical weights.

    Overrides: `architecture` ("qwen2" | "qwen3" | "qwen3_moe" | "llama"), `pad_vocab_to_multiple_of` (tokenizer vocabulary
    padding, default 64 -> 128 tokens), and any HF config field (`hidden_size`, `num_hidden_layers`,
    `num_attention_heads`, `num_key_value_heads`, `intermediate_size`, `tie_word_embeddings`, ...).
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    architecture = overrides.pop("architecture", "qwen2")
    tokenizer = build_tiny_tokenizer(pad_to_multiple_of=overrides.pop("pad_vocab_to_multiple_of", 64))
    model = build_tiny_model(tokenizer, seed=seed, architecture=architecture, **overrides)
    save_quietly(model, out)
    tokenizer.save_pretrained(out)
    logger.info(
        "wrote tiny %s checkpoint (%d parameters, vocab %d) to %s",
        architecture, sum(p.numel() for p in model.parameters()), model.config.vocab_size, out,
    )
    return out


def save_quietly(model, out) -> None:
    """`save_pretrained` without transformers' per-shard progress bar (a one-shard tiny model)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
