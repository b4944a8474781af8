"""Per-GPU memory of the Megatron actor: parameters, gradients, optimizer shards, activations.

Model state (exact for the actor as built, checked against a real CPU run in tests/test_plan.py):
  parameters   local_params x dtype bytes
  gradients    local_params x 4 (the actor reduces gradients in fp32: `grad_reduce_in_fp32=True`)
  optimizer    local_params x (Adam moments 8 [+ fp32 master copy 4 for bf16]) / shards, where
               shards = dp x cp with the distributed optimizer (megatron shards over DP x CP), else 1;
               expert weights (mixture of experts) are sharded over the expert-data-parallel ranks
               instead, world / (pp x ep x etp), and each rank holds num_experts / ep of them (/ etp).

Activations (estimate, per micro-batch of `n` tokens on one rank: `n = max(token budget, seq_len) / cp`,
rounded up as the actor pads for CP/SP),
elements per token and decoder layer, counted with saved-tensor hooks on the local (SDPA) spec:
  6h replicated over TP (two RMSNorms: input, normalised output, linear input)
  + (3 q_dim + 3 kv_dim + 5 ffn + heads) / tp   (q, k, the qkv buffer, attention out, softmax stats, SwiGLU)
  + (2 q_dim + kv_dim + heads + kv_heads) / tp  with per-head q/k norms (Qwen3: the normalised q and k,
                                                 one rms statistic per head)
With sequence parallelism everything is divided by tp. A mixture-of-experts layer replaces the
SwiGLU term by its experts' (an estimate, not hook-counted): each token occupies top_k expert slots,
each saving the permuted input and the expert output (2h) and the expert's SwiGLU tensors
(5 moe_ffn / etp), plus the router's logits and probabilities (2 E); under sequence parallelism the
tokens are first gathered over the expert-TP group (x etp / tp per rank), and all-to-all leaves each
rank about its own number of slots (balanced routing; an imbalanced router puts more on some).
Full recomputation keeps one `h` (/tp with SP) per layer and token, plus one layer's full
activations while it is recomputed.
1F1B keeps `pp` micro-batches in flight on the first stage (x (1 + (pp-1)/(pp*vpp)) interleaved),
one on the last. The last stage also holds the logits and their gradient (`2 n V/tp` x dtype) and
the chunked log-prob temporaries (3 fp32 buffers of `chunk x V/tp`, see actor/logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_bapo.actor.layout import MicroBatchLayout
from megatron_bapo.models.registry import model_args_from_hf
from megatron_bapo.planner.inputs import PlanInputs
from megatron_bapo.planner.layout import validate_layout
from megatron_bapo.planner.params import ParamCounts, count_parameters

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class StageMemory:
    """Bytes on one GPU of one pipeline stage."""

    num_params: int
    params: int
    grads: int
    optimizer: int
    activations: int
    """Without activation recomputation."""
    activations_recompute: int
    """With full recomputation (recompute_granularity=full, uniform, 1 layer per checkpoint)."""
    logits: int
    logprob_chunks: int

    def total(self, recompute: bool) -> int:
        act = self.activations_recompute if recompute else self.activations
        return self.params + self.grads + self.optimizer + act + self.logits + self.logprob_chunks


@dataclass
class MemoryPlan:
    inputs: PlanInputs
    counts: ParamCounts
    dp: int
    tokens_per_microbatch: int
    """Tokens one rank processes per micro-batch (after the CP split)."""
    stages: dict[str, StageMemory]
    warnings: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return int((self.inputs.gpu_memory_gib - self.inputs.reserved_gib) * GIB)

    def peak(self, recompute: bool) -> int:
        return max(s.total(recompute) for s in self.stages.values())

    def fits(self, recompute: bool) -> bool:
        return self.peak(recompute) <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        par = self.inputs.actor.parallel
        return {
            "num_parameters": self.counts.total,
            "num_parameters_padded": self.counts.total_padded,
            "world_size": self.inputs.world_size,
            "num_parameters_active": self.counts.active,
            "tp": par.tp, "pp": par.pp, "cp": par.cp, "dp": self.dp, "ep": par.ep, "etp": par.expert_tp,
            "seq_len": self.inputs.seq_len,
            "tokens_per_microbatch": self.tokens_per_microbatch,
            "stages": {k: dict(vars(v), total=v.total(False), total_recompute=v.total(True)) for k, v in self.stages.items()},
            "peak_bytes": self.peak(False),
            "peak_bytes_recompute": self.peak(True),
            "capacity_bytes": self.capacity,
            "fits": self.fits(False),
            "fits_recompute": self.fits(True),
            "warnings": list(self.warnings),
        }


def _layer_elems_per_token(inputs: PlanInputs) -> tuple[float, float]:
    """(elements saved per token per layer, elements per token per layer under full recompute)."""
    par = inputs.actor.parallel
    ck = model_args_from_hf(inputs.hf_config, vocab_divisible_by=inputs.actor.vocab_divisible_by).config_kwargs
    h, ffn, heads = ck["hidden_size"], ck["ffn_hidden_size"], ck["num_attention_heads"]
    kv_dim = ck["num_query_groups"] * ck["kv_channels"]
    q_dim = heads * ck["kv_channels"]
    experts = ck.get("num_moe_experts")
    sharded = (3 * q_dim + 3 * kv_dim + (0 if experts else 5 * ffn) + heads) / par.tp
    if ck.get("qk_layernorm"):
        sharded += (2 * q_dim + kv_dim + heads + ck["num_query_groups"]) / par.tp
    replicated = 6 * h
    moe = 0.0
    if experts:  # per token of this rank's attention (see the module docstring)
        etp = par.expert_tp
        slots = ck["moe_router_topk"] * (2 * h + 5 * ck["moe_ffn_hidden_size"] / etp)
        moe = 2 * experts + slots * (etp / par.tp if par.sequence_parallel else 1)
    if par.sequence_parallel:
        return replicated / par.tp + sharded + moe, h / par.tp
    return replicated + sharded + moe, float(h)


def c_h(counts: ParamCounts, par) -> int:
    """Hidden elements per token the final norm saves on this rank (/tp under sequence parallelism)."""
    return counts.hidden_size // par.tp if par.sequence_parallel else counts.hidden_size


def plan_memory(inputs: PlanInputs, counts: ParamCounts | None = None) -> MemoryPlan:
    """Validate the layout (PlanError naming the field) and compute per-GPU memory per stage."""
    warnings = validate_layout(inputs)
    actor = inputs.actor
    par = actor.parallel
    counts = counts or count_parameters(inputs.hf_config, vocab_divisible_by=actor.vocab_divisible_by)
    dp = inputs.world_size // par.model_parallel_size
    dtype_bytes = DTYPE_BYTES[actor.dtype]
    optim = actor.optim
    state = 8 if optim.name == "adam" else (4 if optim.sgd_momentum > 0 else 0)
    if actor.dtype != "float32":
        state += 4  # fp32 master weights
    shards = dp * par.cp if actor.use_distributed_optimizer else 1
    expert_shards = inputs.world_size // (par.pp * par.ep * par.expert_tp) if actor.use_distributed_optimizer else 1
    # Tokens per rank: the budget (or one longer sequence), padded to 2*cp chunks and, under sequence
    # parallelism, to a multiple of tp per rank, exactly as the actor lays micro-batches out.
    n = MicroBatchLayout(cp_size=par.cp, sp_size=par.tp if par.sequence_parallel else 1).padded_length(
        max(actor.max_tokens_per_microbatch, inputs.seq_len)) // par.cp
    per_layer, per_layer_rc = _layer_elems_per_token(inputs)
    layers = counts.num_layers // par.pp
    vocab_local = counts.padded_vocab_size // par.tp
    names = ["only"] if par.pp == 1 else ["first", "last"]
    stages = {}
    for name in names:
        if name == "last":
            in_flight = 1.0
        else:
            in_flight = float(par.pp)
            if par.vpp:
                in_flight *= 1 + (par.pp - 1) / (par.pp * par.vpp)
        num = counts.per_rank(par.tp, par.pp, name, par.ep, par.expert_tp)
        num_experts = counts.expert_per_rank(par.pp, par.ep, par.expert_tp)
        last = name in ("last", "only")
        act = in_flight * layers * per_layer * n * dtype_bytes
        act_rc = (in_flight * layers * per_layer_rc + per_layer) * n * dtype_bytes
        stages[name] = StageMemory(
            num_params=num,
            params=num * dtype_bytes,
            grads=num * 4,
            optimizer=((num - num_experts) * state) // shards + (num_experts * state) // expert_shards,
            activations=int(act),
            activations_recompute=int(act_rc),
            # logits and their gradient, plus the final norm's saved input/output/linear input
            logits=(2 * n * vocab_local + (3 * n * c_h(counts, par))) * dtype_bytes if last else 0,
            logprob_chunks=3 * min(actor.logprob_chunk_size, n) * vocab_local * 4 if last else 0,
        )
    return MemoryPlan(inputs=inputs, counts=counts, dp=dp, tokens_per_microbatch=n, stages=stages, warnings=warnings)


def format_plan(plan: MemoryPlan) -> str:
    """Human-readable report (what tools/plan.py prints)."""
    inp, par, c = plan.inputs, plan.inputs.actor.parallel, plan.counts
    arch = (inp.hf_config.get("architectures") or ["?"])[0]
    experts = (f"; {c.num_experts} experts, top-{c.top_k}: {c.active:,} active per token ({c.active / 1e9:.2f}B)"
               if c.num_experts else "")
    ep = (f"; experts: ep {par.ep} x etp {par.expert_tp} x expert-dp {inp.world_size // (par.pp * par.ep * par.expert_tp)}"
          if c.num_experts else "")
    lines = [
        f"model: {arch}, {c.total:,} parameters ({c.total / 1e9:.2f}B; {c.total_padded:,} with vocab padding "
        f"{c.vocab_size}->{c.padded_vocab_size}){experts}",
        f"layout: {inp.world_size} GPUs = tp {par.tp} x pp {par.pp}{f' (vpp {par.vpp})' if par.vpp else ''} x cp {par.cp} "
        f"x dp {plan.dp}{ep}; {c.num_layers // par.pp} layers/stage; sequence_parallel={par.sequence_parallel}; "
        f"dtype {inp.actor.dtype}; distributed optimizer={inp.actor.use_distributed_optimizer}",
        f"sequence: {inp.seq_len} tokens (prompt + response); micro-batch {plan.tokens_per_microbatch} tokens per rank "
        f"(token budget {inp.actor.max_tokens_per_microbatch}, / cp {par.cp}; "
        f"{'packed (THD)' if inp.actor.packing else 'padded'}; recompute {inp.actor.recompute})",
        "",
    ]
    cols = list(plan.stages)
    header = f"{'per GPU (GiB)':<34}" + "".join(f"{k + ' stage':>14}" for k in cols)
    lines.append(header)
    rows = [
        ("parameters", "params"), ("gradients (fp32)", "grads"), ("optimizer shard", "optimizer"),
        ("activations, no recompute", "activations"), ("activations, full recompute", "activations_recompute"),
        ("logits + their gradient", "logits"), ("log-prob chunks (fp32)", "logprob_chunks"),
    ]
    for label, attr in rows:
        lines.append(f"  {label:<32}" + "".join(f"{getattr(plan.stages[k], attr) / GIB:>14.2f}" for k in cols))
    for label, rc in (("total, no recompute", False), ("total, full recompute", True)):
        lines.append(f"  {label:<32}" + "".join(f"{plan.stages[k].total(rc) / GIB:>14.2f}" for k in cols))
    cap = plan.capacity / GIB
    lines.append("")
    lines.append(
        f"capacity {cap:.1f} GiB per GPU ({inp.gpu_memory_gib:g} GiB minus {inp.reserved_gib:g} GiB reserved): "
        f"no recompute {'FITS' if plan.fits(False) else 'DOES NOT FIT'} (peak {plan.peak(False) / GIB:.1f} GiB), "
        f"full recompute {'FITS' if plan.fits(True) else 'DOES NOT FIT'} (peak {plan.peak(True) / GIB:.1f} GiB)"
    )
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
