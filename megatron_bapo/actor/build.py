"""Building the actor: megatron-core model chunks under the parallel layout, DDP, optimizer, schedule.

Separate from the training step (`actor.actor`) and the optimizer step (`actor.optimizer_step`):
what is built once, from `ActorConfig` and the HF config, and how.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_bapo.actor import moe
from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.actor.layout import MicroBatchLayout
from megatron_bapo.models.builder import build_gpt_model
from megatron_bapo.models.layer_spec import describe_attention, resolve_layer_spec
from megatron_bapo.models.moe import routing_tapes
from megatron_bapo.models.parallel import ParallelGroups

logger = logging.getLogger(__name__)


@dataclass
class BuiltActor:
    """What `build_actor` makes; the `Actor` keeps each piece as an attribute of the same name."""

    model: list
    """DDP-wrapped model chunks (one, or one per virtual pipeline stage)."""
    optimizer: Any
    scheduler: Any
    layout: MicroBatchLayout
    hf_vocab_size: int
    routing_tapes: Any
    """The MoE routers' tapes (routing replay and statistics), None for a dense model."""
    chunk_tapes: dict
    """Each wrapped chunk's router tapes, by `id(chunk)` (the forward step feeds them every micro-batch)."""
    moe_shape: Optional[tuple[int, int]]


def build_actor(config: ActorConfig, hf_config: Any, parallel: ParallelGroups) -> BuiltActor:
    """The model chunks (identical initial weights on every DP rank: seeded), wrapped in megatron's
    DistributedDataParallel, megatron's optimizer (distributed or plain) and its LR schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    pc = config.parallel
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    torch.manual_seed(config.seed)  # identical initial weights on every DP rank
    # Micro-batches have different shapes (token budget); PP must then exchange shapes.
    # (megatron rejects variable lengths with the default MoE dispatcher even for dense models.)
    overrides = dict(calculate_per_token_loss=True, sequence_parallel=pc.sequence_parallel,
                     **config.recompute_overrides(), **moe.config_overrides(config, hf_config))
    if pc.pp > 1 and not pc.vpp:
        # Interleaved schedules exchange one fixed shape instead (`BatchSpec.common_shape` pads to it).
        overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    spec = resolve_layer_spec(config.layer_spec)
    chunks = [
        build_gpt_model(hf_config, dtype=dtype, vp_stage=stage if pc.vpp else None, use_te=spec.use_te,
                        vocab_divisible_by=config.vocab_divisible_by, config_overrides=overrides)
        for stage in range(pc.vpp or 1)
    ]
    fused = sorted(k.replace("_fusion", "") for k, v in vars(chunks[0].config).items()
                   if k.endswith("_fusion") and v is True)
    logger.info("model: %s layer spec (%s); %s; fusions: %s", "transformer_engine" if spec.use_te else "local",
                spec.reason, describe_attention(chunks[0].config, spec.use_te), ", ".join(fused) or "none")
    tapes = moe.setup_tapes(chunks, replay=config.routing_replay)
    shape = moe.moe_shape(chunks)
    layout = MicroBatchLayout(packed=config.packing, cp_size=parallel.cp_size, cp_rank=parallel.cp_rank,
                              sp_size=pc.tp if pc.sequence_parallel else 1)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # a non-finite grad norm skips the step instead (actor.optimizer_step)
    )
    model = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
             for i, c in enumerate(chunks)]
    mcfg = model[0].config
    mcfg.finalize_model_grads_func = finalize_model_grads
    mcfg.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    oc = config.optim
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=oc.name, lr=oc.lr, min_lr=oc.min_lr, weight_decay=oc.weight_decay,
            adam_beta1=oc.adam_beta1, adam_beta2=oc.adam_beta2, adam_eps=oc.adam_eps,
            sgd_momentum=oc.sgd_momentum, clip_grad=oc.clip_grad, bf16=dtype == torch.bfloat16,
            params_dtype=dtype, use_distributed_optimizer=config.use_distributed_optimizer,
        ),
        model,
    )
    decay_steps = oc.decay_steps if oc.decay_style != "constant" else max(oc.warmup_steps + 1, 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if oc.warmup_steps else oc.lr, max_lr=oc.lr, min_lr=oc.min_lr,
        lr_warmup_steps=oc.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=oc.decay_style,
        start_wd=oc.weight_decay, end_wd=oc.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        # On resume the config's schedule wins over the checkpoint's (a changed actor.optim.lr is
        # applied at the saved step count, megatron_bapo.resume_policy); megatron's default keeps the saved one.
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )
    logger.info("actor built: %s parameters on this rank, %s, %s micro-batches, %s optimizer",
                f"{sum(p.numel() for m in model for p in m.parameters()):,}", config.dtype,
                "packed" if config.packing else "padded",
                "distributed" if config.use_distributed_optimizer else "plain")
    return BuiltActor(model=model, optimizer=optimizer, scheduler=scheduler, layout=layout,
                      hf_vocab_size=chunks[0].hf_vocab_size, routing_tapes=tapes,
                      chunk_tapes={id(m): routing_tapes(m) for m in model}, moe_shape=shape)
