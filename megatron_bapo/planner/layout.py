"""Layout checks that fail before submission, each naming the config field to change."""

from __future__ import annotations

from megatron_bapo.models.registry import model_args_from_hf
from megatron_bapo.planner.inputs import PlanError, PlanInputs


def validate_layout(inputs: PlanInputs) -> list[str]:
    """Raise PlanError on the first impossible setting; return warnings for legal but poor ones.

    Checks: GPUs divisible by tp*pp*cp; tp divides attention heads, KV heads and the padded vocab;
    pp (x vpp) divides layers; the batch divides into n_minibatches. (Sequence lengths need no
    check: the actor pads each sequence to a multiple of 2*cp and each rank's tokens to a multiple of
    tp under sequence parallelism, `actor.layout`.)
    """
    par = inputs.actor.parallel
    try:
        args = model_args_from_hf(inputs.hf_config, vocab_divisible_by=inputs.actor.vocab_divisible_by)
    except ValueError as exc:
        raise PlanError(f"model config: {exc}") from None
    ck = args.config_kwargs
    heads, kv, layers = ck["num_attention_heads"], ck["num_query_groups"], ck["num_layers"]
    mp = par.tp * par.pp * par.cp
    world = inputs.world_size
    if heads % par.tp:
        raise PlanError(f"actor.parallel.tp={par.tp} must divide num_attention_heads={heads}")
    if kv % par.tp:
        raise PlanError(f"actor.parallel.tp={par.tp} must divide num_key_value_heads={kv}")
    if args.padded_vocab_size % par.tp:
        raise PlanError(
            f"actor.parallel.tp={par.tp} must divide the padded vocab {args.padded_vocab_size} "
            f"(vocab_size={args.vocab_size}, actor.vocab_divisible_by={inputs.actor.vocab_divisible_by})"
        )
    stages = par.pp * (par.vpp or 1)
    if layers % stages:
        raise PlanError(f"actor.parallel.pp={par.pp} (x vpp={par.vpp or 1}) must divide num_hidden_layers={layers}")
    if world < 1 or world % mp:
        raise PlanError(
            f"GPU count {world} is not divisible by actor.parallel.tp*pp*cp = {par.tp}*{par.pp}*{par.cp} = {mp}"
        )
    experts = ck.get("num_moe_experts")
    etp = par.expert_tp
    if par.ep > 1 and not experts:
        raise PlanError(f"actor.parallel.ep={par.ep}: {args.architecture} is not a mixture-of-experts model")
    if experts:
        if experts % par.ep:
            raise PlanError(f"actor.parallel.ep={par.ep} must divide num_experts={experts}")
        if ck["moe_ffn_hidden_size"] % etp:
            raise PlanError(f"actor.parallel.etp={etp} must divide moe_intermediate_size={ck['moe_ffn_hidden_size']}")
        if world % (par.ep * etp * par.pp):
            raise PlanError(f"GPU count {world} is not divisible by actor.parallel.ep*etp*pp = "
                            f"{par.ep}*{etp}*{par.pp} (expert parallelism uses the ranks of a pipeline stage)")
        if par.tp > 1 and not par.sequence_parallel:
            raise PlanError(f"actor.parallel.tp={par.tp} with a mixture-of-experts model needs "
                            "actor.parallel.sequence_parallel=true (megatron-core trains MoE under TP only with it)")
    if inputs.batch_size is not None and inputs.batch_size % inputs.actor.n_minibatches:
        raise PlanError(
            f"actor.n_minibatches={inputs.actor.n_minibatches} must divide the batch "
            f"rollout.prompts_per_step x rollout.group_size = {inputs.batch_size}"
        )
    warnings = []
    dp = world // mp
    if inputs.batch_size is not None and inputs.batch_size // inputs.actor.n_minibatches < dp:
        warnings.append(
            f"a mini-batch has {inputs.batch_size // inputs.actor.n_minibatches} sequences but DP={dp}: "
            f"some DP ranks run only filler micro-batches"
        )
    if par.tp > 1 and not par.sequence_parallel:
        warnings.append("actor.parallel.sequence_parallel=false with tp>1: activations outside attention/MLP are not sharded")
    if inputs.seq_len > int(inputs.hf_config.get("max_position_embeddings", inputs.seq_len)):
        warnings.append(
            f"sequence length {inputs.seq_len} exceeds the model's max_position_embeddings="
            f"{inputs.hf_config.get('max_position_embeddings')}"
        )
    return warnings
