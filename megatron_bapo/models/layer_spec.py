"""Transformer layer spec: Transformer Engine on GPUs, megatron-core local modules + SDPA elsewhere.

megatron-core's local `DotProductAttention` allocates its score buffer on CUDA, so the local spec's
core attention is `SdpaAttention` (`models.cpu_attention`: padded, packed and context-parallel
inputs over `torch.nn.functional.scaled_dot_product_attention`).

The local spec's norms are `SpTorchNorm` instead of megatron's `WrappedTorchNorm` (its fallback when
neither Apex nor TE is installed), which refuses `sequence_parallel=True`
(megatron/core/transformer/torch_norm.py:32) because it does not mark its weights for the TP
all-reduce of sequence-parallel gradients. `SpTorchNorm` builds the same torch module (same
parameter names and values) and marks them, as Apex's FusedLayerNorm and TE's TENorm do.

Model-dependent submodules come from the `TransformerConfig` through `spec_options(config)`: the
per-head query/key norms (`qk_layernorm`, Qwen3), one `head_dim` weight each, built by the same
norm class (`SpTorchNorm` locally, TE's norm on GPUs), and the mixture of experts (`num_experts`,
Qwen3-MoE): megatron-core's `MoELayer` with the project's `ReplayRouter` (`models.moe`), experts as
`SequentialMLP` locally and TE's grouped GEMM (`TEGroupedMLP`, `moe_grouped_gemm`) on GPUs. An MoE
layer's `pre_mlp_layernorm` is a plain norm in both specs (TE cannot fuse it into the experts), so
the local spec keeps its checkpoint key as the TE spec does (`pre_mlp_layernorm.weight`) and a
checkpoint saved on CPU loads on GPUs and back. Their weights are replicated over TP while
each TP rank normalises only its own heads, so their gradients are partial sums on every rank;
megatron's `finalize_model_grads` all-reduces every `q_layernorm`/`k_layernorm` gradient over the
TP group when `config.qk_layernorm` is set, with or without sequence parallelism.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megatron_bapo.models.cpu_attention import sdpa_attention_class

logger = logging.getLogger(__name__)


def have_transformer_engine() -> bool:
    """True when a real Transformer Engine (not the empty PyPI meta-package) is importable."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


class SpTorchNorm:
    """`torch.nn.RMSNorm` / `LayerNorm` with the weights marked `sequence_parallel` as megatron expects.

    Under sequence parallelism each TP rank normalises only its `s/TP` slice of the sequence, so the
    gradient of a (TP-replicated) norm weight is a partial sum on each rank; megatron's
    `finalize_model_grads` all-reduces the gradients of parameters whose `sequence_parallel`
    attribute is True over the TP group (distributed/finalize_model_grads.py:354). Apex's
    `FusedLayerNorm` and TE's `TENorm` set that attribute; megatron's torch fallback
    (`WrappedTorchNorm`) cannot and therefore rejects sequence parallelism outright. Without SP this
    builds exactly what `WrappedTorchNorm` builds. Called like megatron norms via `build_module`.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"SpTorchNorm: TransformerConfig.{flag}=True needs Apex or Transformer Engine")
        # In the model's parameter dtype, as TE's and Apex's norms are (a bf16 model with fp32 norm
        # weights would mix dtypes in every layer).
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"SpTorchNorm: normalization {config.normalization!r} is not supported")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def spec_options(config) -> dict[str, Any]:
    """The `get_layer_spec` arguments that depend on the model, read from its `TransformerConfig`
    (one place, so every builder of a spec, live or on the meta device, gets the same modules)."""
    return {"qk_layernorm": bool(getattr(config, "qk_layernorm", False)),
            "num_experts": getattr(config, "num_moe_experts", None) or None,
            "moe_grouped_gemm": bool(getattr(config, "moe_grouped_gemm", False))}


def get_layer_spec(*, use_te: Optional[bool] = None, qk_layernorm: bool = False, num_experts: Optional[int] = None,
                   moe_grouped_gemm: bool = False):
    """The GPT transformer-layer spec for this machine.

    use_te: None picks TE when CUDA and TE are both present; True requires them (error otherwise);
    False forces the local spec with SDPA attention (works everywhere).
    qk_layernorm: RMSNorm each query and key head before RoPE (Qwen3); pass `**spec_options(config)`.
    num_experts: a mixture-of-experts MLP (megatron `MoELayer`, `ReplayRouter`); moe_grouped_gemm:
    TE's grouped GEMM for the experts (TE spec only; the local spec runs `SequentialMLP`).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_bapo.models.moe import replay_router_class

    te_ok = torch.cuda.is_available() and have_transformer_engine()
    if use_te is None:
        use_te = te_ok
    if use_te:
        if not te_ok:
            raise ValueError("get_layer_spec(use_te=True) needs CUDA and Transformer Engine installed")
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                          qk_layernorm=qk_layernorm)
        if num_experts:
            spec.submodules.mlp.submodules.router = replay_router_class()
        return spec
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=qk_layernorm)
    if num_experts:
        spec.submodules.mlp.submodules.router = replay_router_class()
        # The TE spec's key for an MoE layer's (unfused) norm, so CPU and GPU checkpoints interchange.
        spec.submodules.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = sdpa_attention_class()
    if qk_layernorm:
        attention.q_layernorm = SpTorchNorm
        attention.k_layernorm = SpTorchNorm
    spec.submodules.input_layernorm = SpTorchNorm
    spec.submodules.pre_mlp_layernorm = SpTorchNorm
    return spec


def get_block_spec(config, *, vp_stage: Optional[int] = None, use_te: Optional[bool] = None):
    """The decoder spec for `GPTModel(transformer_layer_spec=...)` on this rank's pipeline stage.

    TE: the layer spec (megatron then picks TENorm for the final norm itself). Local: a
    `TransformerBlockSubmodules` whose final norm is `SpTorchNorm` too, because given a bare layer
    spec megatron would build the final norm from its module-level fallback, `WrappedTorchNorm`.
    Parallel state must be initialised (the layer count depends on the pipeline stage).
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_layer_spec(use_te=use_te, **spec_options(config))
    if spec.submodules.input_layernorm is not SpTorchNorm:
        return spec
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=SpTorchNorm)
