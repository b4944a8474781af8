"""Transformer layer spec: Transformer Engine on GPUs, megatron-core local modules + SDPA elsewhere.

Which one runs is `ActorConfig.layer_spec` ("auto" | "te" | "local"), resolved once per process by
`resolve_layer_spec`: "auto" takes TE when CUDA is present and `transformer_engine.pytorch`
imports; TE that is absent gives the local spec (and the actor's log line says so); TE that is
installed but fails to import (a CUDA/driver mismatch, a missing library) is an error showing TE's
own message, never a silent fallback to the local attention (dense masks, all-gather CP), which
would run out of memory at 64k tokens without saying why.

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
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_bapo.models.cpu_attention import sdpa_attention_class

logger = logging.getLogger(__name__)


LAYER_SPECS = ("auto", "te", "local")
_ABSENT = ("transformer_engine", "transformer_engine.pytorch")


def transformer_engine_absence() -> Optional[str]:
    """None when Transformer Engine's PyTorch API imports; why not, when TE is simply not installed.

    Raises ImportError carrying TE's own message when TE is installed but fails to import (only
    the packages themselves being absent counts as "not installed"; the empty PyPI meta-package
    has no `transformer_engine.pytorch`).
    """
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name in _ABSENT:
            return f"Transformer Engine is not installed (no module {exc.name!r})"
        raise ImportError(f"Transformer Engine is installed but does not import: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - whatever TE raised is the message the user needs
        raise ImportError(f"Transformer Engine is installed but does not import: {type(exc).__name__}: {exc}") from exc
    return None


def have_transformer_engine() -> bool:
    """True when a real Transformer Engine (not the empty PyPI meta-package) imports."""
    try:
        return transformer_engine_absence() is None
    except ImportError:
        return False


@dataclass(frozen=True)
class LayerSpecChoice:
    """The resolved `ActorConfig.layer_spec`."""

    use_te: bool
    reason: str
    """Why this spec (for the actor's log line)."""


def resolve_layer_spec(choice: str = "auto", *, cuda: Optional[bool] = None) -> LayerSpecChoice:
    """`ActorConfig.layer_spec` for this machine (`cuda` defaults to `torch.cuda.is_available()`).

    Raises ValueError naming the field when "te" cannot run, or when TE is installed but broken.
    """
    if choice not in LAYER_SPECS:
        raise ValueError(f"ActorConfig.layer_spec must be one of {LAYER_SPECS}, got {choice!r}")
    if choice == "local":
        return LayerSpecChoice(False, "actor.layer_spec=local")
    if not (torch.cuda.is_available() if cuda is None else cuda):
        if choice == "te":
            raise ValueError("ActorConfig.layer_spec='te' needs CUDA (torch.cuda.is_available() is False); "
                             "use 'auto' or 'local'")
        return LayerSpecChoice(False, "no CUDA")
    try:
        absent = transformer_engine_absence()
    except ImportError as exc:
        raise ValueError(f"ActorConfig.layer_spec={choice!r}: {exc}; fix the Transformer Engine install (it must "
                         "match this torch and CUDA) or set actor.layer_spec=local") from exc
    if absent is None:
        return LayerSpecChoice(True, "Transformer Engine imports")
    if choice == "te":
        raise ValueError(f"ActorConfig.layer_spec='te': {absent}; install it or set actor.layer_spec=local")
    return LayerSpecChoice(False, absent)


def describe_attention(config, use_te: bool) -> str:
    """The attention and context-parallel implementation a model built with this spec runs."""
    if use_te:
        attention = "TEDotProductAttention (fused kernels, THD packing)"
        cp = (f"Transformer Engine context parallel (cp_comm_type={config.cp_comm_type})"
              if config.context_parallel_size > 1 else "no context parallel")
    else:
        attention = "SdpaAttention (torch SDPA; packed sequences bucketed per length, dense masks under CP)"
        cp = ("all-gather of K/V over the CP group" if config.context_parallel_size > 1 else "no context parallel")
    return f"attention {attention}, {cp}"


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

    use_te: None resolves `layer_spec="auto"` (`resolve_layer_spec`); True requires CUDA and TE
    (error otherwise); False forces the local spec with SDPA attention (works everywhere).
    qk_layernorm: RMSNorm each query and key head before RoPE (Qwen3); pass `**spec_options(config)`.
    num_experts: a mixture-of-experts MLP (megatron `MoELayer`, `ReplayRouter`); moe_grouped_gemm:
    TE's grouped GEMM for the experts (TE spec only; the local spec runs `SequentialMLP`).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_bapo.models.moe import replay_router_class

    if use_te is None:
        use_te = resolve_layer_spec("auto").use_te
    if use_te:
        resolve_layer_spec("te")  # raises unless CUDA and TE are both usable
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
