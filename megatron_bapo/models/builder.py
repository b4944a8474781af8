"""Build a megatron-core `GPTModel` from an HF config, for this rank's TP/PP position."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from megatron_bapo.models.layer_spec import get_block_spec, resolve_layer_spec
from megatron_bapo.models.registry import model_args_from_hf

logger = logging.getLogger(__name__)


def gpu_fusions(use_te: bool) -> dict[str, bool]:
    """The kernel fusions this CUDA machine can run; the registry's config keeps them all off (CPU).

    - bias-activation (SwiGLU) and bias-dropout-add: megatron's `jit_fuser` kernels, CUDA only;
    - RoPE: Transformer Engine's fused rotary kernels (megatron checks for them at config time);
    - gradient accumulation into `main_grad` inside the weight-gradient GEMM: Apex's
      `fused_weight_gradient_mlp_cuda` extension (megatron's own linear layers, the output layer
      included, refuse the flag without it, even under the TE spec).
    Masked-softmax fusion belongs to megatron's local `DotProductAttention`, which neither spec uses.
    """
    from megatron.core.tensor_parallel import layers

    fusions = {"bias_activation_fusion": True, "bias_dropout_fusion": True}
    if use_te:
        fusions["apply_rope_fusion"] = True
    if layers._grad_accum_fusion_available:
        fusions["gradient_accumulation_fusion"] = True
    return fusions


def transformer_config_from_hf(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_divisible_by: int = 128,
    **overrides: Any,
):
    """`(TransformerConfig, ModelArgs)` for `hf_config` with parallel sizes from `parallel_state`.

    `overrides` are extra TransformerConfig fields (e.g. recompute_granularity="full").
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    args = model_args_from_hf(hf_config, vocab_divisible_by=vocab_divisible_by)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    ck = args.config_kwargs
    if ck["num_attention_heads"] % tp or ck["num_query_groups"] % tp:
        raise ValueError(
            f"ParallelConfig.tp={tp} must divide num_attention_heads={ck['num_attention_heads']} and "
            f"num_key_value_heads={ck['num_query_groups']}"
        )
    if args.padded_vocab_size % tp:
        raise ValueError(f"ParallelConfig.tp={tp} must divide the padded vocab size {args.padded_vocab_size}")
    if ck["num_layers"] % (pp * (vpp or 1)):
        raise ValueError(f"ParallelConfig.pp={pp} (x vpp={vpp or 1}) must divide num_layers={ck['num_layers']}")
    moe = bool(ck.get("num_moe_experts"))
    if moe and ck["num_moe_experts"] % ep:
        raise ValueError(f"ParallelConfig.ep={ep} must divide the number of experts ({ck['num_moe_experts']})")
    if moe and ck["moe_ffn_hidden_size"] % etp:
        raise ValueError(f"ParallelConfig.etp={etp} must divide moe_intermediate_size={ck['moe_ffn_hidden_size']}")
    if not moe and ep > 1:
        raise ValueError(f"ParallelConfig.ep={ep}: {args.architecture} is not a mixture-of-experts model (set ep: 1)")
    kwargs = dict(
        ck,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
    )
    # TE's grouped GEMM for the experts goes with the TE spec (`build_gpt_model` asks for it there);
    # the local spec runs megatron's SequentialMLP. The checkpoint mapping reads both layouts.
    grouped = bool(overrides.pop("moe_grouped_gemm", False))
    if moe:
        kwargs["moe_grouped_gemm"] = grouped
    if not torch.cuda.is_available():
        # gloo pairs batched isend/irecv wrongly when prev and next stage are the same rank
        # (interleaved PP=2; shared/notes/megatron-core-on-cpu.md).
        kwargs["batch_p2p_comm"] = False
    kwargs.update(overrides)
    return TransformerConfig(**kwargs), args


def build_gpt_model(
    hf_config: Any,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    dtype: torch.dtype = torch.float32,
    vp_stage: Optional[int] = None,
    use_te: Optional[bool] = None,
    vocab_divisible_by: int = 128,
    config_overrides: Optional[dict[str, Any]] = None,
):
    """One `GPTModel` chunk for this rank (parallel_state must be initialised).

    pre_process/post_process default to "this rank holds the first/last pipeline stage" (for
    `vp_stage` when interleaving). With CUDA, the fusions of `gpu_fusions` are on (an explicit
    `config_overrides` entry wins). The model outputs vocab-parallel logits `[b, s, vocab/TP]` when
    called without labels. Attributes `hf_vocab_size` and `padded_vocab_size` are attached.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if use_te is None:
        use_te = resolve_layer_spec("auto").use_te
    overrides = {**(gpu_fusions(use_te) if torch.cuda.is_available() else {}), "moe_grouped_gemm": bool(use_te),
                 **(config_overrides or {})}
    config, args = transformer_config_from_hf(hf_config, dtype=dtype, vocab_divisible_by=vocab_divisible_by, **overrides)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_block_spec(config, vp_stage=vp_stage, use_te=use_te),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        vp_stage=vp_stage,
        **args.gpt_kwargs,
    )
    model.hf_vocab_size = args.vocab_size
    model.padded_vocab_size = args.padded_vocab_size
    model.model_args = args
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
