"""Qwen3-MoE below the trainer: the registry's fields and refusals, the MoE layer spec (megatron-core's
MoELayer with the replay router), the offline conversion round trip with its expert axis, expert
parallelism on gloo ranks (EP=2 and TP=2 x EP=2 against one process: log-probs, loss, gradients) and
resharding a checkpoint saved at EP=2 to EP=1. (HF vs megatron logits and the live round trip at TP 1
and 2 are in test_convert.py, which covers every family; the routing replay in test_routing_replay.py.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from convert_helpers import CONFIGS, IDS, hf_config_dict, hf_logits, make_hf_model, read_safetensors_dir  # noqa: E402

from megatron_bapo.models.registry import model_args_from_hf  # noqa: E402

MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", **CONFIGS["qwen3_moe"][1])


def test_registry_maps_the_router_and_experts():
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(**{k: v for k, v in MOE.items() if k not in ("model_type", "architectures")})
    for cfg in (MOE, hf):
        ck = model_args_from_hf(cfg).config_kwargs
        assert ck["num_moe_experts"] == 8 and ck["moe_router_topk"] == 2 and ck["moe_ffn_hidden_size"] == 40
        # norm_topk_prob: softmax over the chosen experts' logits (megatron's pre_softmax=False)
        assert ck["moe_router_pre_softmax"] is False and ck["moe_router_score_function"] == "softmax"
        assert ck["moe_router_load_balancing_type"] == "none" and ck["moe_aux_loss_coeff"] == 0.0
        assert ck["moe_token_dispatcher_type"] == "alltoall" and ck["qk_layernorm"] is True
    no_norm = model_args_from_hf({**MOE, "norm_topk_prob": False}).config_kwargs
    assert no_norm["moe_router_pre_softmax"] is True  # softmax over all experts, top-k kept as they are
    # transformers 5 writes num_local_experts into config.json
    legacy = {k: v for k, v in MOE.items() if k != "num_experts"}
    assert model_args_from_hf({**legacy, "num_local_experts": 4}).config_kwargs["num_moe_experts"] == 4


@pytest.mark.parametrize(
    "change, match",
    [
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\].*only a mixture of experts in every layer"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"shared_expert_intermediate_size": 64}, "no shared expert"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"attention_bias": True}, "Qwen3MoeForCausalLM: attention_bias=True"),
    ],
)
def test_registry_refuses_what_it_would_not_reproduce(change, match):
    with pytest.raises(ValueError, match=match):
        model_args_from_hf({**MOE, **change})


def test_layer_spec_is_megatron_moe_with_the_replay_router():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_bapo.models.layer_spec import SpTorchNorm, get_layer_spec, spec_options
    from megatron_bapo.models.moe import replay_router_class

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=2,
                            moe_ffn_hidden_size=40, qk_layernorm=True, normalization="RMSNorm",
                            use_cpu_initialization=True, add_bias_linear=False)
    assert spec_options(cfg) == {"qk_layernorm": True, "num_experts": 8, "moe_grouped_gemm": False}
    spec = get_layer_spec(use_te=False, **spec_options(cfg))
    mlp = spec.submodules.mlp
    assert mlp.module is MoELayer and mlp.submodules.router is replay_router_class()
    assert mlp.submodules.experts.module is SequentialMLP and spec.submodules.pre_mlp_layernorm is SpTorchNorm
    # the TE spec's checkpoint key for the (unfused) MoE norm: CPU and GPU checkpoints interchange
    assert spec.submodules.sharded_state_dict_keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}


# --------------------------------------------------------------------------- offline conversion
def _to_megatron(rank, world_size, hf_dir, mdir, back_dir):
    from megatron_bapo.convert.offline import hf_to_megatron, megatron_to_hf

    hf_to_megatron(hf_dir, mdir)
    megatron_to_hf(mdir, back_dir, max_shard_bytes=30_000)


def _load_checkpoint_logits(rank, world_size, hf_dir, mdir, layout):
    from convert_helpers import megatron_logits

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(optim=OptimConfig(name="sgd", lr=0.5), parallel=ParallelConfig(**layout),
                      use_distributed_optimizer=False)
    actor = Actor(cfg, hf_config_dict(hf_dir))
    actor.load_checkpoint(mdir, load_optimizer=False)
    return megatron_logits(actor.model[0].module, IDS, hf_config_dict(hf_dir)["vocab_size"], actor.parallel.tp_group)


def test_offline_round_trip_is_bit_exact_and_the_checkpoint_loads(tmp_path, run_dist):
    """HF -> torch_dist -> HF gives back every tensor bit for bit (per-expert HF tensors through the
    checkpoint's stacked expert axis); the converted checkpoint loads into an actor whose logits are HF's."""
    hf_dir = make_hf_model("qwen3_moe", tmp_path / "hf", seed=4)
    mdir, back = tmp_path / "mg", tmp_path / "back"
    run_dist(_to_megatron, 1, hf_dir, mdir, back, timeout=120)
    src, dst = read_safetensors_dir(hf_dir), read_safetensors_dir(back)
    assert sorted(src) == sorted(dst) and "model.layers.1.mlp.experts.7.down_proj.weight" in dst
    for k in src:
        assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), k
    logits = run_dist(_load_checkpoint_logits, 1, hf_dir, mdir, {}, timeout=120)[0]
    torch.testing.assert_close(logits, hf_logits(hf_dir, IDS), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- expert parallelism on gloo ranks
def _moe_actor(hf_dir, *, tp=1, pp=1, ep=1, etp=None, sp=False, distopt=False, **kw):
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.models.parallel import ParallelConfig

    optim = OptimConfig(name="adam", lr=1e-3, clip_grad=0.0) if distopt else OptimConfig(name="sgd", lr=0.05, clip_grad=0.0)
    cfg = ActorConfig(optim=optim, parallel=ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=sp),
                      vocab_divisible_by=64, use_distributed_optimizer=distopt, **kw)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    actor = Actor(cfg, hf_config)
    load_hf_into_model(actor.model, hf_dir, hf_config=hf_config)
    actor.optimizer.reload_model_params()
    return actor


def hf_params(actor) -> dict[str, torch.Tensor]:
    """Every weight by its HF name, gathered over TP, expert-TP and EP (collective on every rank)."""
    from megatron_bapo.convert import iter_hf_tensors

    p = actor.parallel
    buckets = iter_hf_tensors(actor.model, actor.hf_config, gather_to="all", tp_group=p.tp_group, pp_group=p.pp_group,
                              etp_group=p.etp_group, ep_group=p.ep_group)
    return {n: t.clone() for bucket in buckets for n, t in bucket}


def _moe_step(rank, world_size, hf_dir, layout):
    from strict_devices import StrictDevices

    layout = dict(layout)
    recorded = layout.pop("recorded", False)  # a recorded routing in the batch, replayed
    # Under StrictDevices: megatron's default-backend groups refuse host tensors, as NCCL does.
    with StrictDevices():
        return _moe_step_checked(hf_dir, layout, recorded)


def _moe_step_checked(hf_dir, layout, recorded):
    from test_actor_helpers import make_batch

    actor = _moe_actor(hf_dir, routing_replay=recorded, **layout)
    b = make_batch(num_seqs=8, max_len=23, seed=3, vocab=actor.hf_vocab_size)
    b["temperature"] = 0.6
    if recorded:  # a top-k set of distinct experts per (token, layer), as a server records them
        num_layers, num_experts = actor.moe_shape
        g = torch.Generator().manual_seed(5)
        scores = torch.rand((*b["input_ids"].shape, num_layers, num_experts), generator=g)
        b["routed_experts"] = scores.argsort(-1)[..., :actor.hf_config.num_experts_per_tok].to(torch.int16)
    lp = actor.compute_logprobs(b)
    g = torch.Generator().manual_seed(4)
    b["behavior_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    before = hf_params(actor)
    metrics = actor.train_step(b)
    after = hf_params(actor)
    return {"lp": lp, "metrics": metrics, "lp_after": actor.compute_logprobs(b),
            "update": {k: after[k] - before[k] for k in after}, "ep": actor.parallel.ep_size}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("moe"), seed=0, architecture="qwen3_moe"))


@pytest.fixture(scope="module")
def moe_reference(moe_dir):
    from dist_harness import run_dist

    return run_dist(_moe_step, 1, moe_dir, {}, timeout=120)[0]


MOE_METRICS = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl_k1", "bapo/c_high", "bapo/c_low",
               "actor/clipfrac", "actor/num_loss_tokens", "moe/load_balance")


@pytest.mark.parametrize(
    "layout, world_size",
    [({"ep": 2}, 2), pytest.param({"tp": 2, "sp": True, "ep": 2}, 4, marks=pytest.mark.slow),
     pytest.param({"tp": 2, "sp": True, "ep": 2, "etp": 1}, 4, marks=pytest.mark.slow)],
    ids=["ep2", "tp2-sp-ep2", "tp2-sp-ep2-etp1"],
)
def test_expert_parallel_equals_one_process(run_dist, moe_dir, moe_reference, layout, world_size):
    """Log-probs (temperature 0.6), loss, gradient norm, every parameter's SGD update (-lr x gradient,
    the router's and each expert's included) and the log-probs after the step equal one process."""
    ref = moe_reference
    assert ref["metrics"]["moe/load_balance"] > 1.0  # the router is uneven, not degenerate
    results = run_dist(_moe_step, world_size, moe_dir, layout, timeout=300)
    for got in results:
        assert got["ep"] == 2
        torch.testing.assert_close(got["lp"], ref["lp"], atol=2e-6, rtol=0)
        for k in MOE_METRICS:
            assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), k
        torch.testing.assert_close(got["lp_after"], ref["lp_after"], atol=1e-5, rtol=0)
        assert sorted(got["update"]) == sorted(ref["update"])
        for name, upd in ref["update"].items():
            torch.testing.assert_close(got["update"][name], upd, atol=1e-7, rtol=1e-5, msg=name)
    experts = [u for n, u in ref["update"].items() if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3 and max(u.abs().max() for u in experts) > 1e-4  # experts were trained


@pytest.mark.slow
def test_replay_through_pipeline_stages_equals_one_process(run_dist, moe_dir):
    """PP 2 x EP 2: the scattered batch brings every stage its layers' recorded routing; the replayed
    forward, loss, update and `moe/*` metrics equal one process replaying the same routing."""
    ref = run_dist(_moe_step, 1, moe_dir, {"recorded": True}, timeout=120)[0]
    assert ref["metrics"]["moe/routing_replayed"] == pytest.approx(1.0)
    assert ref["metrics"]["moe/routing_mismatch"] > 0.5  # random routing: replay changed what the routers chose
    for got in run_dist(_moe_step, 4, moe_dir, {"recorded": True, "pp": 2, "ep": 2}, timeout=300):
        torch.testing.assert_close(got["lp"], ref["lp"], atol=2e-6, rtol=0)
        for k in (*MOE_METRICS, "moe/routing_replayed", "moe/routing_mismatch", "moe/routing_recorded"):
            assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), k
        for name, upd in ref["update"].items():
            torch.testing.assert_close(got["update"][name], upd, atol=1e-7, rtol=1e-5, msg=name)


@pytest.mark.slow  # EP 2 against one process stays in the inner loop (test_expert_parallel_equals_one_process)
def test_expert_parallel_distributed_optimizer_equals_one_process(run_dist, moe_dir):
    """megatron's distributed optimizer (Adam, expert parameters sharded over their own data-parallel
    group) at EP=2 takes the single-process step."""
    ref = run_dist(_moe_step, 1, moe_dir, {"distopt": True}, timeout=120)[0]
    for got in run_dist(_moe_step, 2, moe_dir, {"ep": 2, "distopt": True}, timeout=240):
        torch.testing.assert_close(got["lp"], ref["lp"], atol=2e-6, rtol=0)
        assert got["metrics"]["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=1e-5)
        torch.testing.assert_close(got["lp_after"], ref["lp_after"], atol=1e-5, rtol=0)
        # Adam magnifies fp32 noise where |g| is near its eps (updates are up to lr = 1e-3): the untied
        # tiny MoE's worst element differs by 1.07e-5, so compare at 2e-5.
        for name, upd in ref["update"].items():
            torch.testing.assert_close(got["update"][name], upd, atol=2e-5, rtol=1e-3, msg=name)


@pytest.mark.gpu
def test_a_full_moe_step_on_one_gpu_with_nccl(moe_dir):
    """A whole step on a one-rank NCCL world: the search pass over the mini-batch, the loss, the routing
    replay of a recorded routing, megatron's distributed optimizer, the metrics with moe/load_balance and
    the export's gather. NCCL refuses a host tensor in any collective, so one anywhere fails this test
    (`_moe_step`'s StrictDevices is its CPU stand-in). Not run on a GPU yet: no GPU was lent to the
    session that wrote it; its body is `_moe_step`'s, which runs on CPU in this module."""
    import math
    import os

    from dist_harness import free_port
    from megatron.core import parallel_state

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        got = _moe_step_checked(moe_dir, {"distopt": True}, recorded=True)
        assert torch.distributed.get_backend() == "nccl"
    finally:
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for key in MOE_METRICS:
        assert key in got["metrics"] and math.isfinite(got["metrics"][key]), (key, got["metrics"].get(key))
    assert got["metrics"]["actor/grad_norm"] > 0 and (got["lp_after"] - got["lp"]).abs().max() > 0


# --------------------------------------------------------------------------- resharding EP=2 -> EP=1
def _save_at(rank, world_size, hf_dir, ckpt, hf_out, layout):
    from megatron_bapo.convert import save_model_as_hf

    actor = _moe_actor(hf_dir, **layout)
    if ckpt is not None:
        actor.load_checkpoint(ckpt, load_optimizer=False)
    else:
        ckpt = hf_out.parent / "ckpt"
        actor.save_checkpoint(ckpt)
    save_model_as_hf(actor.model, actor.hf_config, hf_out, parallel=actor.parallel, max_shard_bytes=60_000)
    return actor.parallel.ep_rank, actor.parallel.dp_rank


def _offline_export(rank, world_size, ckpt, out, template):
    from megatron_bapo.convert.offline import megatron_to_hf

    megatron_to_hf(ckpt, out, hf_template=template)


@pytest.mark.slow  # the offline round trip stays in the inner loop
def test_round_trip_through_an_ep2_checkpoint_is_bit_exact(tmp_path, run_dist):
    """HF -> actor at EP=2 -> (a) HF from the live model (the second EP rank's experts come from data-
    parallel rank 1), (b) a torch_dist checkpoint -> actor at EP=1 -> HF, (c) the same checkpoint ->
    offline HF: every tensor is the source's, bit for bit."""
    hf_dir = make_hf_model("qwen3_moe", tmp_path / "hf", seed=6)
    src = read_safetensors_dir(hf_dir)
    live, via_ep1, offline = tmp_path / "live" / "hf", tmp_path / "ep1", tmp_path / "offline"
    ranks = run_dist(_save_at, 2, hf_dir, None, live, {"ep": 2, "distopt": True}, timeout=240)
    assert sorted(ranks) == [(0, 0), (1, 1)]  # EP is carved out of the data-parallel ranks
    run_dist(_save_at, 1, hf_dir, tmp_path / "live" / "ckpt", via_ep1, {}, timeout=120)
    run_dist(_offline_export, 1, tmp_path / "live" / "ckpt", offline, hf_dir, timeout=120)
    for out in (live, via_ep1, offline):
        dst = read_safetensors_dir(out)
        assert sorted(dst) == sorted(src), out
        for k in src:
            assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), (out, k)


def _resume(rank, world_size, hf_dir, ckpt):
    """Two Adam steps straight through, and the second one again after a save / load."""
    from test_actor_helpers import make_batch

    batches = [make_batch(num_seqs=8, max_len=23, seed=s, vocab=128) for s in (1, 2)]
    actor = _moe_actor(hf_dir, ep=2, distopt=True)
    actor.train_step(batches[0])
    actor.save_checkpoint(ckpt)
    actor.train_step(batches[1])
    straight = hf_params(actor)
    resumed = _moe_actor(hf_dir, ep=2, distopt=True)
    resumed.load_checkpoint(ckpt)
    resumed.train_step(batches[1])
    return straight, hf_params(resumed)


@pytest.mark.slow
def test_ep2_distributed_optimizer_checkpoint_resumes_exactly(tmp_path, run_dist, moe_dir):
    """The chain of dense and expert distributed optimizers saves and loads every member's state:
    the step after a resume equals the uninterrupted one."""
    for straight, resumed in run_dist(_resume, 2, moe_dir, tmp_path / "ckpt", timeout=240):
        for name, t in straight.items():
            torch.testing.assert_close(resumed[name], t, atol=1e-6, rtol=0, msg=name)


def _layout_errors(rank, world_size, moe_dir, dense_dir):
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    errors = []
    for hf_dir, parallel in ((moe_dir, ParallelConfig(tp=2)), (dense_dir, ParallelConfig(ep=2))):
        try:
            Actor(ActorConfig(parallel=parallel), AutoConfig.from_pretrained(hf_dir))
        except ValueError as exc:
            errors.append(str(exc))
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return errors


def test_layouts_megatron_cannot_train_are_refused_by_name(run_dist, moe_dir, tiny_hf_dir):
    errors = run_dist(_layout_errors, 2, moe_dir, str(tiny_hf_dir), timeout=120)[0]
    assert len(errors) == 2
    assert "parallel.tp=2 with a mixture-of-experts model needs parallel.sequence_parallel=True" in errors[0]
    assert "ParallelConfig.ep=2: Qwen2ForCausalLM is not a mixture-of-experts model" in errors[1]
