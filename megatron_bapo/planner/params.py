"""Parameter counts per rank, from a megatron-core GPTModel built on the meta device.

The model is built once with TP = PP = 1 (no memory: every tensor is on `meta`); megatron-core marks
each tensor-parallel parameter with `tensor_model_parallel` (and its split dimension), so a rank's
share under any TP is `numel / tp` for those and `numel` for the replicated ones (norms). Pipeline
stages hold `num_layers / pp` identical decoder layers; the first stage adds the embedding, the last
the final norm and output layer (with tied embeddings and pp > 1 the last stage holds a copy).

Mixture of experts: a layer's expert weights (`mlp.experts.*`) split over the expert-parallel ranks
(each holds num_experts / ep experts) and each expert over the expert-tensor-parallel ranks, not over
TP; the router is replicated. A token uses `top_k` of the experts, so the ACTIVE parameters per
token are the total minus the unused experts' share (Qwen3-30B-A3B: 30.5B total, 3.3B active).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass
class ParamCounts:
    """Parameter numbers of one model, TP-unsharded, from its meta-device build."""

    num_layers: int
    layer_sharded: int
    """Per decoder layer: elements of tensor-parallel parameters (split over TP)."""
    layer_replicated: int
    """Per decoder layer: elements replicated on every TP rank (norm weights)."""
    embedding: int
    """Word embedding elements (padded vocab x hidden)."""
    output_layer: int
    """Output layer elements (padded vocab x hidden); 0 when tied to the embedding."""
    final_norm: int
    padded_vocab_size: int
    vocab_size: int
    hidden_size: int
    tied: bool
    layer_experts: int = 0
    """Per decoder layer: elements of the expert weights (all experts; part of `layer_sharded`)."""
    num_experts: int = 0
    top_k: int = 0

    @property
    def active(self) -> int:
        """Parameters one token uses: the total without the experts it is not routed to."""
        if not self.num_experts:
            return self.total
        unused = self.layer_experts * (self.num_experts - self.top_k) // self.num_experts
        return self.total - self.num_layers * unused

    def expert_per_rank(self, pp: int, ep: int, etp: int) -> int:
        """Expert elements one rank holds (its experts of its stage's layers, its expert-TP part)."""
        return (self.num_layers // pp) * (self.layer_experts // (ep * etp))

    @property
    def total_padded(self) -> int:
        """What megatron allocates at TP = PP = 1 (padded vocabulary rows included)."""
        layers = self.num_layers * (self.layer_sharded + self.layer_replicated)
        return layers + self.embedding + self.output_layer + self.final_norm

    @property
    def total(self) -> int:
        """The model's true parameter count (as the HF checkpoint counts it: no vocab padding)."""
        pad_rows = self.padded_vocab_size - self.vocab_size
        copies = 1 if self.tied else 2
        return self.total_padded - copies * pad_rows * self.hidden_size

    def per_rank(self, tp: int, pp: int, stage: str, ep: int = 1, etp: int = 1) -> int:
        """Elements held by one rank of pipeline `stage` ("first", "last" or "only" when pp == 1)."""
        layers = self.num_layers // pp
        dense = self.layer_sharded - self.layer_experts
        count = layers * (dense // tp + self.layer_replicated) + self.expert_per_rank(pp, ep, etp)
        first = stage in ("first", "only")
        last = stage in ("last", "only")
        if first:
            count += self.embedding // tp
        if last:
            count += self.final_norm
            if self.output_layer:
                count += self.output_layer // tp
            elif not first:
                count += self.embedding // tp  # tied: the last stage keeps its own copy for the output
        return count


@contextlib.contextmanager
def _single_rank_parallel_state() -> Iterator[None]:
    """megatron parallel state with TP = PP = 1 on a private 1-rank gloo group (torn down after).

    If torch.distributed is already initialised, the caller's megatron state must be TP = PP = 1.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        if ps.model_parallel_is_initialized() and (
            ps.get_tensor_model_parallel_world_size() != 1 or ps.get_pipeline_model_parallel_world_size() != 1
        ):
            raise RuntimeError("count_parameters: run it outside a TP/PP>1 job (it builds a TP=PP=1 meta model)")
        created_ps = not ps.model_parallel_is_initialized()
        if created_ps:
            ps.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            if created_ps:
                ps.destroy_model_parallel()
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            ps.initialize_model_parallel(1, 1)
            yield
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def count_parameters(hf_config: Any, *, vocab_divisible_by: int = 128, dtype: torch.dtype = torch.bfloat16) -> ParamCounts:
    """Build the GPTModel for `hf_config` on the meta device and count its parameters.

    Uses the project's registry and local layer spec (same parameter shapes as the TE spec, whose
    fused norm+linear modules hold the same norm weights). No weights are read or allocated.
    """
    from megatron.core.models.gpt import GPTModel

    from megatron_bapo.models.builder import transformer_config_from_hf
    from megatron_bapo.models.layer_spec import get_layer_spec, spec_options

    if not torch.cuda.is_available():
        from megatron_bapo.models import cpu_compat

        cpu_compat.install()
    with _single_rank_parallel_state(), torch.device("meta"):
        config, args = transformer_config_from_hf(
            hf_config, dtype=dtype, vocab_divisible_by=vocab_divisible_by,
            use_cpu_initialization=True, perform_initialization=True,
        )
        model = GPTModel(
            config=config, transformer_layer_spec=get_layer_spec(use_te=False, **spec_options(config)), pre_process=True,
            post_process=True, parallel_output=True, **args.gpt_kwargs,
        )
    per_layer: dict[int, list[int]] = {}
    experts: dict[int, int] = {}
    embedding = output = final_norm = 0
    for name, p in model.named_parameters():
        m = _LAYER.match(name)
        if m:
            slot = per_layer.setdefault(int(m.group(1)), [0, 0])
            slot[0 if getattr(p, "tensor_model_parallel", False) else 1] += p.numel()
            if ".mlp.experts." in name:
                experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + p.numel()
        elif name.startswith("embedding.word_embeddings"):
            embedding += p.numel()
        elif name.startswith("output_layer"):
            output += p.numel()
        elif name.startswith("decoder.final_layernorm"):
            final_norm += p.numel()
        else:
            raise ValueError(f"count_parameters: unexpected parameter {name!r} (the planner does not know where it lives)")
    shapes = {tuple(v) for v in per_layer.values()}
    if len(shapes) != 1:
        raise ValueError(f"count_parameters: decoder layers differ in size {sorted(shapes)}; only uniform layers are planned")
    sharded, replicated = shapes.pop()
    return ParamCounts(
        num_layers=len(per_layer), layer_sharded=sharded, layer_replicated=replicated, embedding=embedding,
        output_layer=output, final_norm=final_norm, padded_vocab_size=args.padded_vocab_size,
        vocab_size=args.vocab_size, hidden_size=config.hidden_size,
        tied=bool(args.gpt_kwargs.get("share_embeddings_and_output_weights")),
        layer_experts=max(experts.values(), default=0), num_experts=int(config.num_moe_experts or 0),
        top_k=int(config.moe_router_topk or 0) if config.num_moe_experts else 0,
    )
