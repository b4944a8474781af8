"""Explicit registry: HF `architectures` name -> megatron-core model arguments.

One entry per model family; each maps a Hugging Face config (a transformers `PretrainedConfig` or a
plain dict, e.g. a parsed config.json) to the `TransformerConfig` fields and `GPTModel` arguments
that build the same network. Unknown architectures fail with the list of supported ones.

Vocabulary padding rule (shared with the weight converter): the embedding and output layer have
`padded_vocab_size = ceil(vocab_size / vocab_divisible_by) * vocab_divisible_by` rows, independent
of TP so that checkpoints reshard between TP sizes; the TP size must divide it. Rows beyond the HF
`vocab_size` are zero in converted weights and are masked out (-inf) when computing log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch.nn.functional as F


@dataclass
class ModelArgs:
    """Everything needed to build a `GPTModel` for one HF config (parallel sizes come later)."""

    architecture: str
    config_kwargs: dict[str, Any]
    """Keyword arguments of megatron-core `TransformerConfig` (no parallel sizes, no dtype)."""
    gpt_kwargs: dict[str, Any]
    """Keyword arguments of megatron-core `GPTModel` (vocab, positions, rope, tying)."""
    vocab_size: int
    """The HF vocabulary size (real tokens)."""
    padded_vocab_size: int
    extra: dict[str, Any] = field(default_factory=dict)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


MODEL_TYPE_TO_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                      "llama": "LlamaForCausalLM"}
"""Used only when a config object has no `architectures` (e.g. built in code, not loaded)."""


def architecture_of(cfg: Any) -> str:
    """The one HF `architectures` name of a config (or its `model_type`'s, for configs built in code)."""
    archs = _get(cfg, "architectures") or []
    if not archs and _get(cfg, "model_type") in MODEL_TYPE_TO_ARCH:
        return MODEL_TYPE_TO_ARCH[_get(cfg, "model_type")]
    if len(archs) != 1:
        raise ValueError(
            f"HF config 'architectures' must name exactly one architecture, got {archs!r}; "
            f"supported: {supported_architectures()}"
        )
    return archs[0]


def padded_vocab(vocab_size: int, vocab_divisible_by: int) -> int:
    if vocab_divisible_by < 1:
        raise ValueError(f"vocab_divisible_by must be >= 1, got {vocab_divisible_by}")
    return int(math.ceil(vocab_size / vocab_divisible_by) * vocab_divisible_by)


def rope_parameters(cfg: Any) -> dict:
    """RoPE settings from either transformers layout: v5 `rope_parameters` (theta inside) or v4
    top-level `rope_theta` + `rope_scaling`. Returns a dict with at least `rope_theta`, `rope_type`."""
    params = dict(_get(cfg, "rope_parameters") or {})
    scaling = _get(cfg, "rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = _get(cfg, "rope_theta") or 10000.0
    return params


def _common(cfg: Any, arch: str, vocab_divisible_by: int) -> ModelArgs:
    """Fields shared by Llama-style decoders (RMSNorm, SwiGLU, RoPE, GQA)."""
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv_heads = int(_get(cfg, "num_key_value_heads") or heads)
    head_dim = int(_get(cfg, "head_dim") or hidden // heads)
    act = _get(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act={act!r} is not supported (only 'silu', i.e. SwiGLU)")
    if heads % kv_heads:
        raise ValueError(f"{arch}: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    vocab = int(_get(cfg, "vocab_size"))
    padded = padded_vocab(vocab, vocab_divisible_by)
    config_kwargs = dict(
        num_layers=int(_get(cfg, "num_hidden_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(cfg, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(_get(cfg, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=float(_get(cfg, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(_get(cfg, "initializer_range", 0.02)),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    gpt_kwargs = dict(
        vocab_size=padded,
        max_sequence_length=int(_get(cfg, "max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=float(rope_parameters(cfg)["rope_theta"]),
        share_embeddings_and_output_weights=bool(_get(cfg, "tie_word_embeddings", False)),
    )
    return ModelArgs(arch, config_kwargs, gpt_kwargs, vocab, padded)


def _qwen2(cfg: Any, vocab_divisible_by: int) -> ModelArgs:
    """Qwen2 / Qwen2.5: bias on q/k/v only; optional tied embeddings; no sliding window in training."""
    _reject_sliding_window(cfg, "Qwen2ForCausalLM")
    args = _common(cfg, "Qwen2ForCausalLM", vocab_divisible_by)
    args.config_kwargs["add_qkv_bias"] = True
    _reject_rope_scaling(cfg, "Qwen2ForCausalLM")
    return args


def _qwen3(cfg: Any, vocab_divisible_by: int) -> ModelArgs:
    """Qwen3 dense: RMSNorm on every query and key head before RoPE (megatron-core `qk_layernorm`,
    one `head_dim` weight shared by all heads), no biases, an explicit `head_dim` that may differ
    from hidden_size / num_attention_heads (`kv_channels`), tied (0.6B-4B) or untied (8B+) head."""
    return _qwen3_attention(cfg, "Qwen3ForCausalLM", vocab_divisible_by)


def _qwen3_attention(cfg: Any, arch: str, vocab_divisible_by: int) -> ModelArgs:
    """What every Qwen3 shares (the attention, norms, RoPE): a Qwen3 MoE adds its experts to these."""
    if _get(cfg, "attention_bias", False):
        # HF puts the bias on o_proj too; megatron's add_qkv_bias covers q/k/v only.
        raise ValueError(f"{arch}: attention_bias=True is not supported (no released Qwen3 uses it)")
    _reject_sliding_window(cfg, arch)
    _reject_rope_scaling(cfg, arch)
    args = _common(cfg, arch, vocab_divisible_by)
    args.config_kwargs["qk_layernorm"] = True
    return args


def _qwen3_moe(cfg: Any, vocab_divisible_by: int) -> ModelArgs:
    """Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention with a mixture of experts in every layer.

    The router is a linear layer scored with a softmax over all experts; each token goes to the
    `num_experts_per_tok` best, weighted by their probabilities renormalised over the chosen ones
    (`norm_topk_prob`, as every released Qwen3-MoE), which is megatron's softmax over the top-k
    logits (`moe_router_pre_softmax=False`); without renormalisation, megatron's softmax-then-top-k
    (`moe_router_pre_softmax=True`). No shared expert. Router scores in fp32 (`moe_router_dtype`),
    tokens exchanged between expert-parallel ranks by all-to-all (`moe_token_dispatcher_type`), no
    token dropping; the load-balancing loss is off here (`moe_router_load_balancing_type="none"`)
    and turned on by the actor's `moe_aux_loss_coeff`.
    """
    arch = "Qwen3MoeForCausalLM"
    args = _qwen3_attention(cfg, arch, vocab_divisible_by)
    num_experts = int(_get(cfg, "num_experts") or _get(cfg, "num_local_experts") or 0)
    topk = int(_get(cfg, "num_experts_per_tok") or 0)
    if num_experts < 1 or not 1 <= topk <= num_experts:
        raise ValueError(f"{arch}: num_experts={num_experts} and num_experts_per_tok={topk} must satisfy "
                         f"1 <= num_experts_per_tok <= num_experts")
    dense = list(_get(cfg, "mlp_only_layers") or [])
    step = int(_get(cfg, "decoder_sparse_step", 1) or 1)
    if dense or step != 1:
        raise ValueError(f"{arch}: mlp_only_layers={dense} / decoder_sparse_step={step}: only a mixture of experts "
                         f"in every layer is supported (mlp_only_layers: [], decoder_sparse_step: 1)")
    if _get(cfg, "shared_expert_intermediate_size"):
        raise ValueError(f"{arch}: shared_expert_intermediate_size is set; Qwen3-MoE has no shared expert")
    args.config_kwargs.update(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(_get(cfg, "norm_topk_prob", False)),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )
    args.extra["router_aux_loss_coef"] = float(_get(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    return args


def _reject_sliding_window(cfg: Any, arch: str) -> None:
    """Training attends over the whole sequence; a config with sliding-window layers would differ."""
    if _get(cfg, "use_sliding_window", False):
        raise ValueError(f"{arch}: use_sliding_window=True is not supported (set it to false)")
    sliding = [i for i, kind in enumerate(_get(cfg, "layer_types") or []) if kind != "full_attention"]
    if sliding:
        raise ValueError(f"{arch}: layer_types has non-full attention at layers {sliding} (only 'full_attention' is supported)")


def _llama(cfg: Any, vocab_divisible_by: int) -> ModelArgs:
    """Llama 2/3/3.x: no biases; Llama 3.1+ rope scaling ("llama3" type)."""
    if _get(cfg, "attention_bias", False) or _get(cfg, "mlp_bias", False):
        raise ValueError("LlamaForCausalLM: attention_bias/mlp_bias=True are not supported")
    args = _common(cfg, "LlamaForCausalLM", vocab_divisible_by)
    scaling = rope_parameters(cfg)
    kind = scaling["rope_type"]
    if kind != "default":
        if kind != "llama3":
            raise ValueError(f"LlamaForCausalLM: rope_scaling type {kind!r} is not supported (only 'llama3')")
        # megatron-core's llama3 scaling fixes these three; anything else would silently differ.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if key in scaling and float(scaling[key]) != want:
                raise ValueError(f"LlamaForCausalLM: rope_scaling.{key}={scaling[key]} is not supported (megatron-core uses {want})")
        args.gpt_kwargs["rope_scaling"] = True
        args.gpt_kwargs["rope_scaling_factor"] = float(scaling.get("factor", 8.0))
    return args


def _reject_rope_scaling(cfg: Any, arch: str) -> None:
    params = rope_parameters(cfg)
    if params["rope_type"] != "default":
        raise ValueError(f"{arch}: rope type {params['rope_type']!r} is not supported (only 'default')")


MODEL_REGISTRY: dict[str, Callable[[Any, int], ModelArgs]] = {
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "LlamaForCausalLM": _llama,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def model_args_from_hf(hf_config: Any, *, vocab_divisible_by: int = 128) -> ModelArgs:
    """Map an HF config (PretrainedConfig or dict) to megatron-core model arguments.

    Raises ValueError naming the architecture/field for anything the mapping does not reproduce.
    """
    arch = architecture_of(hf_config)
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {supported_architectures()}")
    return MODEL_REGISTRY[arch](hf_config, vocab_divisible_by)
