"""Every `ActorConfig` / `OptimConfig` / `ParallelConfig` / `BapoConfig` field reaches the code that acts on it.

Three actors on real gloo ranks are built with a NON-default value in every field (one with TP 2,
PP 2 x VPP 2 and sequence parallelism; one with CP 2, the distributed optimizer and bf16; a
mixture of experts with EP 2 x expert-TP 1, routing replay and the load-balancing loss), run a
train step, and each field is checked where it acts: megatron-core's TransformerConfig, DDP
config, optimizer config, LR schedule and process groups, or the actor's own calls (recorded by
wrappers that delegate to the real functions). A field added to a config without a check here
fails `test_every_field_has_a_check`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from datetime import timedelta

import pytest
import torch

pytest.importorskip("megatron.core")

from test_actor_helpers import TINY_QWEN2, make_batch  # noqa: E402

TINY4 = dict(TINY_QWEN2, num_hidden_layers=4)
TINY_MOE = dict(TINY_QWEN2, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                tie_word_embeddings=False)

BAPO = dict(rho0=0.35, low_start=0.55, low_max=0.85, high_start=1.25, high_max=2.5, high_step=0.1, low_step=0.03,
            contribution="surrogate", weight="rollout_prob", metric="printed", order="verl", dual_clip=2.5)
OPTIM_SGD = dict(name="sgd", lr=3e-3, min_lr=1e-4, warmup_steps=2, decay_style="cosine", decay_steps=50,
                 weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, sgd_momentum=0.7, clip_grad=0.5)
COMMON = dict(max_tokens_per_microbatch=40, n_minibatches=2, ppo_epochs=2, search_scope="microbatch",
              loss_agg="seq-mean-token-sum", seed=77, logprob_chunk_size=5, vocab_divisible_by=48,
              max_skipped_steps=3, recompute="full", layer_spec="local")
# The behavior log-probs are the trainer's minus 0.05: every ratio is exp(0.05) = 1.051, outside the
# mismatch band's 1.04, and its k3 KL (1.3e-3) is above warn_kl.
MISMATCH = dict(band=(0.6, 1.04), warn_kl=1e-4)
LAYOUT_A = dict(parallel=dict(tp=2, pp=2, vpp=2, sequence_parallel=True, backend="gloo", timeout_minutes=7),
                optim=OPTIM_SGD, packing=True, use_distributed_optimizer=False, dtype="float32",
                old_logprobs="recompute", correction=dict(mode="seq_mis", band=(0.8, 1.25)), mismatch=MISMATCH,
                **COMMON)
LAYOUT_B = dict(parallel=dict(cp=2, backend="gloo", timeout_minutes=9), optim=dict(OPTIM_SGD, name="adam"),
                packing=False, use_distributed_optimizer=True, dtype="bfloat16", old_logprobs="recompute",
                correction=dict(mode="tis", tis_cap=1.5), mismatch=MISMATCH, **COMMON)
LAYOUT_MOE = dict(parallel=dict(ep=2, etp=1, backend="gloo", timeout_minutes=5), optim=dict(OPTIM_SGD, name="adam"),
                  packing=True, use_distributed_optimizer=True, dtype="float32", routing_replay=True,
                  moe_aux_loss_coeff=0.01, old_logprobs="recompute", correction=dict(mode="tis", tis_cap=1.5),
                  mismatch=MISMATCH, **COMMON)
# ActorConfig defaults: packing=True, use_distributed_optimizer=True, dtype="float32": each layout
# turns the ones it can (SGD needs the plain optimizer; bf16 runs with the distributed one).


class Recorder:
    """Wraps a function of the actor module: records its keyword arguments, then calls it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.fn(*args, **kwargs)


def _build_and_step(rank, world_size, layout, model=TINY4):
    from megatron.core import tensor_parallel

    import megatron_bapo.actor.actor as actor_mod
    import megatron_bapo.actor.scatter as scatter_mod
    import megatron_bapo.algorithms.importance as importance_mod
    import megatron_bapo.algorithms.objective as objective_mod
    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.actor.scatter import PreparedBatch
    from megatron_bapo.config_io import from_dict

    import megatron_bapo.actor.build as build_mod
    import megatron_bapo.actor.passes as passes_mod

    spies = {"vocab_parallel_logprobs": Recorder(passes_mod.vocab_parallel_logprobs),  # the model passes call it
             "resolve_layer_spec": Recorder(build_mod.resolve_layer_spec)}  # build_actor calls it
    for name in ("search_clip_bounds", "policy_loss"):  # the actor's loss calls them (ppo_clip)
        spies[name] = Recorder(getattr(objective_mod, name))
    spies["aggregation_weights"] = Recorder(scatter_mod.aggregation_weights)
    for name in ("tis_weights", "mis_weights", "seq_mis_weights"):
        spies[name] = Recorder(getattr(importance_mod, name))
    homes = {"aggregation_weights": scatter_mod, "tis_weights": importance_mod, "mis_weights": importance_mod,
             "seq_mis_weights": importance_mod, "search_clip_bounds": objective_mod, "policy_loss": objective_mod,
             "vocab_parallel_logprobs": passes_mod, "resolve_layer_spec": build_mod}
    for name, spy in spies.items():
        setattr(homes.get(name, actor_mod), name, spy)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("megatron_bapo.actor").addHandler(Keep())  # the package's modules (actor, build, passes)
    cfg = from_dict(ActorConfig, {**layout, "bapo": BAPO}, "actor")
    actor = Actor(cfg, model)
    b = make_batch(num_seqs=8, max_len=24, seed=5)
    if model.get("num_experts"):  # a recorded routing for every token: what routing replay forces
        g = torch.Generator().manual_seed(6)
        shape = (*b["input_ids"].shape, model["num_hidden_layers"], model["num_experts"])
        b["routed_experts"] = torch.rand(shape, generator=g).argsort(-1)[..., :model["num_experts_per_tok"]].short()
    b["behavior_logprobs"] = actor.compute_logprobs(b) - 0.05
    layer_specs = [c[0][0] for c in spies["resolve_layer_spec"].calls]
    for spy in spies.values():
        spy.calls.clear()
    first = PreparedBatch(b, actor.batch_spec).for_rank(actor.coords).minibatches[0].microbatches  # rows 0-3
    num_microbatches = len(first)
    packed_microbatches = ["cu_seqlens" in mb for mb in first]
    spies["aggregation_weights"].calls.clear()
    metrics = actor.train_step(b)
    recompute_seconds = actor.phase_times["recompute"]
    bad = dict(b, advantages=b["advantages"] * float("nan"))
    with pytest.raises(RuntimeError, match="max_skipped_steps"):
        for _ in range(10):  # non-finite mini-batches are skipped until max_skipped_steps is exceeded
            actor.train_step(bad)
    mcfg = actor.model[0].config
    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    tp_backend = actor.parallel.tp_group._get_backend(torch.device("cpu"))
    return {
        "tc": {k: getattr(mcfg, k) for k in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "sequence_parallel", "recompute_granularity", "recompute_method",
            "recompute_num_layers", "params_dtype", "bf16", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "moe_aux_loss_coeff", "moe_router_load_balancing_type")},
        "ep_size": torch.distributed.get_world_size(actor.parallel.ep_group),
        "replay_flags": {t.replay for t in actor.routing_tapes},
        "ddp_distributed_optimizer": actor.model[0].ddp_config.use_distributed_optimizer,
        "optimizer_classes": sorted({type(o).__name__ for o in inner}),
        "torch_optimizers": sorted({type(o.optimizer).__name__ for o in inner}),
        "oc": {k: getattr(inner[0].config, k) for k in (
            "optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum",
            "clip_grad")},
        "momentum": [g.get("momentum") for o in inner for g in o.optimizer.param_groups],
        "sched": {k: getattr(actor.scheduler, k) for k in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
                                                            "lr_decay_style")},
        "backend": torch.distributed.get_backend(),
        "timeout": tp_backend.options._timeout,
        "seeds": sorted(tensor_parallel.get_cuda_rng_tracker().seeds_),
        "tp_rank": actor.parallel.tp_rank,
        "padded_vocab": actor.model[0].module.padded_vocab_size,
        "num_microbatches": num_microbatches,
        "metrics": metrics,
        "skipped_at_error": actor.num_skipped_steps,
        "packed_microbatches": packed_microbatches,
        "search": [c[0][3] for c in spies["search_clip_bounds"].calls],
        "num_searches": len(spies["search_clip_bounds"].calls),
        "dual_clip": {c[1]["dual_clip"] for c in spies["policy_loss"].calls},
        "chunk_sizes": {c[1]["chunk_size"] for c in spies["vocab_parallel_logprobs"].calls},
        "aggs": {c[0][1] for c in spies["aggregation_weights"].calls},
        "params_dtype": {p.dtype for m in actor.model for p in m.parameters()},
        "is_last_stage": actor.parallel.is_last_stage,
        "layer_specs": layer_specs,
        "core_attention": type(actor.model[0].module.decoder.layers[0].self_attention.core_attention).__name__,
        "recompute_seconds": recompute_seconds,
        "rank": rank,
        "tis_caps": {c[0][3] for c in spies["tis_weights"].calls},
        "bands": {tuple(c[0][3]) for c in spies["seq_mis_weights"].calls + spies["mis_weights"].calls},
        "corrections": {n for n in ("tis_weights", "mis_weights", "seq_mis_weights") if spies[n].calls},
        "mismatch_warnings": [w for w in warnings if "training-inference mismatch" in w],
    }


# field path -> check(layout, result of one rank). Every config field must have one.
CHECKS = {
    "parallel.tp": lambda L, r: r["tc"]["tensor_model_parallel_size"] == L["parallel"].get("tp", 1),
    "parallel.pp": lambda L, r: r["tc"]["pipeline_model_parallel_size"] == L["parallel"].get("pp", 1),
    "parallel.cp": lambda L, r: r["tc"]["context_parallel_size"] == L["parallel"].get("cp", 1),
    "parallel.vpp": lambda L, r: r["tc"]["virtual_pipeline_model_parallel_size"] == L["parallel"].get("vpp"),
    "parallel.sequence_parallel": lambda L, r: r["tc"]["sequence_parallel"] == L["parallel"].get("sequence_parallel", False),
    "parallel.ep": lambda L, r: r["tc"]["expert_model_parallel_size"] == L["parallel"].get("ep", 1) == r["ep_size"],
    "parallel.etp": lambda L, r: r["tc"]["expert_tensor_parallel_size"]
    == L["parallel"].get("etp", L["parallel"].get("tp", 1)),
    "parallel.backend": lambda L, r: r["backend"] == L["parallel"]["backend"],
    "parallel.timeout_minutes": lambda L, r: r["timeout"] == timedelta(minutes=L["parallel"]["timeout_minutes"]),
    "optim.name": lambda L, r: r["oc"]["optimizer"] == L["optim"]["name"]
    and r["torch_optimizers"] == (["SGD"] if L["optim"]["name"] == "sgd" else ["AdamW"]),  # decoupled decay
    "optim.lr": lambda L, r: r["oc"]["lr"] == L["optim"]["lr"] == r["sched"]["max_lr"],
    "optim.min_lr": lambda L, r: r["oc"]["min_lr"] == L["optim"]["min_lr"] == r["sched"]["min_lr"],
    "optim.warmup_steps": lambda L, r: r["sched"]["lr_warmup_steps"] == L["optim"]["warmup_steps"],
    "optim.decay_style": lambda L, r: r["sched"]["lr_decay_style"] == L["optim"]["decay_style"],
    "optim.decay_steps": lambda L, r: r["sched"]["lr_decay_steps"] == L["optim"]["decay_steps"],
    "optim.weight_decay": lambda L, r: r["oc"]["weight_decay"] == L["optim"]["weight_decay"],
    "optim.adam_beta1": lambda L, r: r["oc"]["adam_beta1"] == L["optim"]["adam_beta1"],
    "optim.adam_beta2": lambda L, r: r["oc"]["adam_beta2"] == L["optim"]["adam_beta2"],
    "optim.adam_eps": lambda L, r: r["oc"]["adam_eps"] == L["optim"]["adam_eps"],
    "optim.sgd_momentum": lambda L, r: r["oc"]["sgd_momentum"] == L["optim"]["sgd_momentum"]
    and (L["optim"]["name"] != "sgd" or set(r["momentum"]) == {L["optim"]["sgd_momentum"]}),
    "optim.clip_grad": lambda L, r: r["oc"]["clip_grad"] == L["optim"]["clip_grad"],
    # 4 rows of <= 24 tokens under a 40-token budget: more than one micro-batch
    "max_tokens_per_microbatch": lambda L, r: r["num_microbatches"] >= 2,
    "packing": lambda L, r: set(r["packed_microbatches"]) == {L["packing"]},
    "n_minibatches": lambda L, r: r["metrics"]["actor/num_optimizer_steps"] == L["n_minibatches"] * L["ppo_epochs"],
    "ppo_epochs": lambda L, r: r["metrics"]["actor/num_optimizer_steps"] == L["n_minibatches"] * L["ppo_epochs"],
    # "microbatch" scope: one search per micro-batch inside the loss, on the last stage only
    "search_scope": lambda L, r: (r["num_searches"] > L["n_minibatches"] * L["ppo_epochs"]) == r["is_last_stage"],
    "loss_agg": lambda L, r: r["aggs"] == {L["loss_agg"]},
    "use_distributed_optimizer": lambda L, r: r["ddp_distributed_optimizer"] == L["use_distributed_optimizer"]
    and ("DistributedOptimizer" in r["optimizer_classes"]) == L["use_distributed_optimizer"],
    "seed": lambda L, r: L["seed"] + 2718 + r["tp_rank"] in r["seeds"],  # megatron's TP-region RNG stream
    "dtype": lambda L, r: r["params_dtype"] == {torch.bfloat16 if L["dtype"] == "bfloat16" else torch.float32}
    and r["tc"]["bf16"] == (L["dtype"] == "bfloat16"),
    "logprob_chunk_size": lambda L, r: r["chunk_sizes"] == ({L["logprob_chunk_size"]} if r["is_last_stage"] else set()),
    "vocab_divisible_by": lambda L, r: r["padded_vocab"] == -(-TINY4["vocab_size"] // L["vocab_divisible_by"]) * L["vocab_divisible_by"],
    "max_skipped_steps": lambda L, r: r["skipped_at_error"] == L["max_skipped_steps"] + 1,
    "recompute": lambda L, r: (r["tc"]["recompute_granularity"], r["tc"]["recompute_method"],
                               r["tc"]["recompute_num_layers"]) == ("full", "uniform", 1),
    "layer_spec": lambda L, r: r["layer_specs"] == [L["layer_spec"]] and r["core_attention"] == "SdpaAttention",
    # every router forces the batch's recorded experts (dense models have no router)
    "routing_replay": lambda L, r: r["replay_flags"] == ({True} if L.get("routing_replay") else set())
    and (not L.get("routing_replay") or r["metrics"]["moe/routing_replayed"] > 0.5),
    "moe_aux_loss_coeff": lambda L, r: r["tc"]["moe_aux_loss_coeff"] == L.get("moe_aux_loss_coeff", 0.0)
    and (not L.get("moe_aux_loss_coeff") or r["tc"]["moe_router_load_balancing_type"] == "aux_loss"),
    "bapo.dual_clip": lambda L, r: not r["is_last_stage"] or r["dual_clip"] == {BAPO["dual_clip"]},
    # the recompute pass ran; the configured correction made the weights, with its own cap / band
    "old_logprobs": lambda L, r: (r["recompute_seconds"] > 0) == (L["old_logprobs"] == "recompute"),
    "correction.mode": lambda L, r: r["corrections"] == ({f"{L['correction']['mode']}_weights"}
                                                         if r["is_last_stage"] else set()),
    "correction.tis_cap": lambda L, r: L["correction"]["mode"] != "tis" or not r["is_last_stage"]
    or r["tis_caps"] == {L["correction"]["tis_cap"]},
    "correction.band": lambda L, r: "mis" not in L["correction"]["mode"] or not r["is_last_stage"]
    or r["bands"] == {L["correction"]["band"]},
    # every token's ratio (1.051) is outside the band's 1.04; the k3 KL (1.3e-3) above warn_kl: one warning
    "mismatch.band": lambda L, r: r["metrics"]["mismatch/frac_outside_band"] == 1.0,
    "mismatch.warn_kl": lambda L, r: len(r["mismatch_warnings"]) == (r["rank"] == 0),  # global rank 0 warns
    **{f"bapo.{k}": (lambda k, v: lambda L, r: not r["is_last_stage"]
                     or (bool(r["search"]) and all(getattr(c, k) == v for c in r["search"])))(k, v)
       for k, v in BAPO.items() if k != "dual_clip"},
}


def _field_paths() -> set[str]:
    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.config import OptimConfig
    from megatron_bapo.algorithms import BapoConfig
    from megatron_bapo.models.parallel import ParallelConfig

    from megatron_bapo.actor.mismatch import MismatchConfig
    from megatron_bapo.algorithms.importance import CorrectionConfig

    from megatron_bapo.algorithms import CispoConfig, DppoConfig, SapoConfig

    nested = {"optim": OptimConfig, "bapo": BapoConfig, "parallel": ParallelConfig, "correction": CorrectionConfig,
              "mismatch": MismatchConfig, "dppo": DppoConfig, "cispo": CispoConfig, "sapo": SapoConfig}
    out = set()
    for f in dataclasses.fields(ActorConfig):
        if f.name in nested:
            out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(nested[f.name])}
        else:
            out.add(f.name)
    return out


def test_every_field_has_a_check():
    from test_loss_fields import OWNED  # the policy-loss fields are checked there

    assert not set(CHECKS) & OWNED
    assert set(CHECKS) | OWNED == _field_paths(), f"fields without a check: {sorted(_field_paths() - set(CHECKS) - OWNED)}"
    assert set(BAPO) == {p.split(".", 1)[1] for p in _field_paths() if p.startswith("bapo.")}


@pytest.mark.parametrize("layout, world_size, model", [(LAYOUT_A, 4, TINY4), (LAYOUT_B, 2, TINY4), (LAYOUT_MOE, 2, TINY_MOE)],
                         ids=["tp2-pp2-vpp2-sp-packed", "cp2-distopt-bf16", "moe-ep2-etp1-replay"])
def test_every_field_reaches_where_it_acts(run_dist, layout, world_size, model):
    for res in run_dist(_build_and_step, world_size, layout, model, timeout=300):
        failed = sorted(k for k, check in CHECKS.items() if not check(layout, res))
        assert not failed, f"fields that did not arrive: {failed}"
        assert math.isfinite(res["metrics"]["actor/loss"])
