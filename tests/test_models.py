"""Registry (HF config -> megatron args), layer spec, builder and ParallelConfig validation."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from test_actor_helpers import TINY_LLAMA, TINY_QWEN2  # noqa: E402

from megatron_bapo.models.parallel import ParallelConfig  # noqa: E402
from megatron_bapo.models.registry import model_args_from_hf, supported_architectures  # noqa: E402


def test_registry_maps_qwen2_fields():
    from transformers import Qwen2Config

    hf = Qwen2Config(**{k: v for k, v in TINY_QWEN2.items() if k != "model_type"})
    for cfg in (TINY_QWEN2, hf):
        args = model_args_from_hf(cfg)
        ck, gk = args.config_kwargs, args.gpt_kwargs
        assert args.architecture == "Qwen2ForCausalLM"
        assert ck["add_qkv_bias"] is True and ck["add_bias_linear"] is False
        assert ck["num_query_groups"] == 2 and ck["kv_channels"] == 16 and ck["ffn_hidden_size"] == 128
        assert ck["normalization"] == "RMSNorm" and ck["gated_linear_unit"] is True
        assert ck["layernorm_epsilon"] == 1e-6
        assert gk["rotary_base"] == 10000.0 and gk["share_embeddings_and_output_weights"] is True
        assert args.vocab_size == 100 and args.padded_vocab_size == 128 == gk["vocab_size"]


def test_registry_maps_llama3_rope_scaling_from_both_transformers_layouts():
    from transformers import LlamaConfig

    fields = {k: v for k, v in TINY_LLAMA.items() if k not in ("model_type", "max_position_embeddings")}
    hf = LlamaConfig(max_position_embeddings=16384, **fields)  # v5: theta and scaling in rope_parameters
    for cfg in (TINY_LLAMA, hf):
        args = model_args_from_hf(cfg)
        assert args.config_kwargs["add_qkv_bias"] is False
        assert args.gpt_kwargs["rotary_base"] == 500000.0
        assert args.gpt_kwargs["rope_scaling"] is True and args.gpt_kwargs["rope_scaling_factor"] == 8.0
        assert args.gpt_kwargs["share_embeddings_and_output_weights"] is False


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["MistralForCausalLM"]}, "supported: \\['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\\]"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ],
)
def test_registry_rejects_what_it_cannot_reproduce(change, match):
    with pytest.raises(ValueError, match=match):
        model_args_from_hf({**TINY_QWEN2, **change})
    assert supported_architectures() == ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


def test_llama_rope_scaling_with_unsupported_factors_fails():
    bad = {**TINY_LLAMA, "rope_scaling": {**TINY_LLAMA["rope_scaling"], "high_freq_factor": 2.0}}
    with pytest.raises(ValueError, match="high_freq_factor"):
        model_args_from_hf(bad)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"tp": 0}, "tp"), ({"pp": -1}, "pp"), ({"backend": "mpi"}, "backend"),
     ({"vpp": 2}, "vpp"), ({"sequence_parallel": True}, "sequence_parallel")],
)
def test_parallel_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ParallelConfig.{field}"):
        ParallelConfig(**kwargs)


def test_parallel_config_checks_layout_against_model():
    with pytest.raises(ValueError, match="ParallelConfig.tp=3 must divide the number of attention heads"):
        ParallelConfig(tp=3).validate_model(num_layers=2, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match="KV heads"):
        ParallelConfig(tp=4).validate_model(num_layers=2, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match="ParallelConfig.pp=3"):
        ParallelConfig(pp=3).validate_model(num_layers=2, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(ValueError, match="world size 3"):
        ParallelConfig(tp=2).dp_size(3)
    assert ParallelConfig(tp=2, pp=2).dp_size(8) == 2


def _build_both(rank, world_size):
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.layer_spec import sdpa_attention_class
    from megatron_bapo.models.parallel import initialize_model_parallel

    groups = initialize_model_parallel(ParallelConfig(tp=world_size))
    out = {}
    for name, cfg in (("qwen2", TINY_QWEN2), ("llama", TINY_LLAMA)):
        model = build_gpt_model(cfg)
        attn = model.decoder.layers[0].self_attention.core_attention
        ids = torch.randint(0, cfg["vocab_size"], (2, 9))
        pos = torch.arange(9).unsqueeze(0).expand(2, -1)
        logits = model(ids, pos, None)
        out[name] = {
            "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
            "logits": tuple(logits.shape),
            "sdpa": isinstance(attn, sdpa_attention_class()),
            "tp": groups.tp_rank,
        }
    return out


def test_builder_builds_both_families_under_tp2(run_dist):
    for res in run_dist(_build_both, 2, timeout=120):
        q, llama = res["qwen2"], res["llama"]
        assert q["sdpa"] and llama["sdpa"]
        assert q["logits"] == (2, 9, 64)  # padded vocab 128 / TP 2
        assert q["shapes"]["decoder.layers.0.self_attention.linear_qkv.bias"] == ((4 + 2 * 2) * 16 // 2,)
        assert "output_layer.weight" not in q["shapes"]  # tied
        assert llama["shapes"]["output_layer.weight"] == (64, 64)  # untied, 128 / 2 rows
        assert "decoder.layers.0.self_attention.linear_qkv.bias" not in llama["shapes"]
        assert llama["shapes"]["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 96 // 2, 64)  # gate+up


def test_sdpa_attention_matches_explicit_causal_gqa_attention():
    from megatron.core.transformer import TransformerConfig

    from megatron_bapo.models.layer_spec import sdpa_attention_class

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    attn = sdpa_attention_class()(cfg, layer_number=1, attn_mask_type=None, attention_type="self")
    g = torch.Generator().manual_seed(0)
    sq, b = 5, 2
    q = torch.randn(sq, b, 4, 8, generator=g)
    k = torch.randn(sq, b, 2, 8, generator=g)
    v = torch.randn(sq, b, 2, 8, generator=g)
    out = attn(q, k, v, None)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / math.sqrt(8)
    scores = scores.masked_fill(torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(sq, b, 32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_te_layer_spec_on_gpu():
    from megatron_bapo.models.layer_spec import get_layer_spec, have_transformer_engine

    if not have_transformer_engine():
        pytest.skip("Transformer Engine is not installed")
    spec = get_layer_spec()
    assert "TE" in spec.submodules.self_attention.submodules.core_attention.__name__


def _from_hf_dir(rank, world_size, path):
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    hf = AutoConfig.from_pretrained(path)
    actor = Actor(ActorConfig(parallel=ParallelConfig(tp=world_size)), hf)
    ids = torch.randint(1, hf.vocab_size, (2, 12))
    return actor.compute_logprobs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}), hf.vocab_size


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("megatron_bapo.tiny") is None, reason="megatron_bapo.tiny not landed yet"
)
def test_builds_from_the_tiny_hf_checkpoint_config(run_dist, tiny_hf_dir):
    (lp, vocab), = run_dist(_from_hf_dir, 1, str(tiny_hf_dir), timeout=120)
    assert torch.isfinite(lp).all() and (lp[:, 1:] < 0).all()
    assert lp[:, 1:].mean() > -2 * math.log(vocab)  # a random model is near uniform


# --------------------------------------------------------------------------- sequence parallelism
def test_sp_torch_norm_marks_weights_for_the_tp_reduction():
    """The local spec's norm: torch's RMSNorm/LayerNorm as before, weights marked `sequence_parallel` under SP."""
    from megatron.core.transformer import TransformerConfig

    from megatron_bapo.models.layer_spec import SpTorchNorm, get_layer_spec

    spec = get_layer_spec(use_te=False)
    assert spec.submodules.input_layernorm is SpTorchNorm and spec.submodules.pre_mlp_layernorm is SpTorchNorm
    for sp, normalization, cls in ((True, "RMSNorm", torch.nn.RMSNorm), (False, "LayerNorm", torch.nn.LayerNorm)):
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization=normalization,
                                sequence_parallel=sp, tensor_model_parallel_size=2 if sp else 1,
                                use_cpu_initialization=True)
        norm = SpTorchNorm(cfg, 32, eps=1e-6)
        assert type(norm) is cls and norm.eps == 1e-6
        assert [n for n, _ in norm.named_parameters()] == (["weight"] if sp else ["weight", "bias"])
        assert all(p.sequence_parallel is sp for p in norm.parameters())


RECOMPUTE_FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _sp_fwd_bwd(rank, world_size, hf_dir, tp, pp, sp, overrides, record):
    """Forward + backward of 2 micro-batches [2, 12] through megatron's schedule and finalize_model_grads,
    the way the actor runs a step (DDP, fp32 grad buffers, a log-prob loss on vocab-parallel logits).

    Returns a dict: lp and full-vocab logits (last stage, else None), grads {(rule name, layer): this
    TP rank's grad}, tp_rank, the recorded SP collectives (when `record`) and the recompute count.
    """
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from convert_helpers import hf_config_dict
    from megatron_bapo.actor.logprobs import token_aligned_logprobs
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.convert.live import named_model_tensors
    from megatron_bapo.convert.families import get_mapping
    from megatron_bapo.models import cpu_compat
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.parallel import initialize_model_parallel

    rng_hits = cpu_compat.shim_hits().get("rng_state", 0)
    calls = []
    if record:  # which raw collectives SP uses, and on which group (test-only wrappers)
        import megatron.core.tensor_parallel.layers as mlayers
        import megatron.core.tensor_parallel.mappings as mmappings

        for mod in (mlayers, mmappings):
            for fname in ("dist_all_gather_func", "dist_reduce_scatter_func"):
                def wrap(f, tag=f"{mod.__name__.rsplit('.', 1)[1]}.{fname}"):
                    def inner(out, inp, group=None, async_op=False):
                        calls.append((tag, f.__name__, group, async_op))
                        return f(out, inp, group=group, async_op=async_op)
                    return inner
                setattr(mod, fname, wrap(getattr(mod, fname)))

    hf = hf_config_dict(hf_dir)
    groups = initialize_model_parallel(ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp))
    model = build_gpt_model(hf, config_overrides=dict(sequence_parallel=sp, **overrides))
    load_hf_into_model([model], hf_dir)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        module=model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    g = torch.Generator().manual_seed(1)
    mbs = [torch.randint(1, hf["vocab_size"], (2, 12), generator=g) for _ in range(2)]
    weights = [torch.randn(2, 12, generator=g) for _ in range(2)]
    seen = []

    def loss_fn(i, logits):
        # With SP the output layer gathers the sequence first: logits are [b, s, V/TP], full s.
        assert tuple(logits.shape) == (2, 12, model.padded_vocab_size // tp), logits.shape
        lp, _ = token_aligned_logprobs(logits, mbs[i], tp_group=groups.tp_group, vocab_size=hf["vocab_size"],
                                       with_entropy=False)
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits.detach().contiguous(), group=groups.tp_group)
        seen.append((lp.detach(), torch.cat(parts, dim=-1)[..., : hf["vocab_size"]]))
        return (lp * weights[i]).sum(), {}

    def forward_step(data_iterator, m):
        i = next(data_iterator)
        pos = torch.arange(12).unsqueeze(0).expand(2, -1)
        return m(mbs[i], pos, None), partial(loss_fn, i)

    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(range(2)), model=ddp, num_microbatches=2,
        seq_length=12, micro_batch_size=2, forward_only=False,
    )
    mapping = get_mapping(hf)
    grads = {(rule.megatron[0], layer): param.main_grad.clone()
             for _, (_, layer, _), rule, param in named_model_tensors([ddp], mapping)}
    return dict(
        lp=torch.stack([s[0] for s in seen]) if seen else None,
        logits=torch.stack([s[1] for s in seen]) if seen else None,
        grads=grads,
        tp_rank=groups.tp_rank,
        calls=[(tag, fname, grp is groups.tp_group, async_op) for tag, fname, grp, async_op in calls],
        recomputed=cpu_compat.shim_hits().get("rng_state", 0) - rng_hits,  # CheckpointFunction ran
    )


def _unshard_grads(results, tp):
    """Full (TP=1 layout) grads by (rule, layer) from every rank's results (pipeline stages merged)."""
    from megatron_bapo.convert.families import get_mapping
    from megatron_bapo.convert.mapping import unshard

    rules = {r.megatron[0]: r for r in get_mapping(TINY_QWEN2).rules}
    by_key: dict = {}
    for res in results:
        for key, grad in res["grads"].items():
            by_key.setdefault(key, {})[res["tp_rank"]] = grad
    for key, parts in by_key.items():
        if rules[key[0]].kind == "replicated":  # norms: SP's TP all-reduce leaves every rank the same grad
            assert all(torch.equal(parts[r], parts[0]) for r in range(tp)), key
    return {key: unshard(rules[key[0]], [parts[r] for r in range(tp)]) for key, parts in by_key.items()}


def _last_stage(results):
    return next(r for r in results if r["lp"] is not None)


@pytest.fixture(scope="module")
def sp_hf_dir(tmp_path_factory):
    from convert_helpers import make_hf_model

    return make_hf_model("qwen2_tied", tmp_path_factory.mktemp("sp_qwen2"))


@pytest.fixture(scope="module")
def tp1_reference(sp_hf_dir):
    from dist_harness import run_dist

    return run_dist(_sp_fwd_bwd, 1, str(sp_hf_dir), 1, 1, False, {}, False, timeout=120)


def _max_diffs(ref, got, tp):
    """Max |diff| of logits and log-probs, and max over parameters of max|grad diff| / max|ref grad|."""
    ref_lp, ref_logits = _last_stage(ref)["lp"], _last_stage(ref)["logits"]
    lp, logits = _last_stage(got)["lp"], _last_stage(got)["logits"]
    ref_grads, grads = _unshard_grads(ref, 1), _unshard_grads(got, tp)
    tied = ("output_layer.weight", None)  # the last stage's copy of the tied embedding (PP > 1)
    if tied in grads:  # finalize_model_grads all-reduces it with the embedding's grad
        ref_grads[tied] = ref_grads[("embedding.word_embeddings.weight", None)]
    assert set(grads) == set(ref_grads)
    for key in ref_grads:
        assert grads[key].shape == ref_grads[key].shape, key
        assert ref_grads[key].abs().max() > 0, key  # every parameter gets a gradient
    grad_diff = max(((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()).item() for k in ref_grads)
    return (logits - ref_logits).abs().max().item(), (lp - ref_lp).abs().max().item(), grad_diff


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full_recompute"])
def test_tp2_sequence_parallel_matches_tp1(run_dist, sp_hf_dir, tp1_reference, recompute):
    """TP=2 + sequence parallelism on gloo: logits, log-probs and every parameter's gradient equal TP=1."""
    overrides = RECOMPUTE_FULL if recompute else {}
    got = run_dist(_sp_fwd_bwd, 2, str(sp_hf_dir), 2, 1, True, overrides, True, timeout=120)
    logits_diff, lp_diff, grad_diff = _max_diffs(tp1_reference, got, 2)
    print(f"TP2+SP recompute={recompute}: max|dlogits|={logits_diff:.2e} max|dlp|={lp_diff:.2e} max rel|dgrad|={grad_diff:.2e}")
    assert logits_diff < 1e-5 and lp_diff < 1e-5 and grad_diff < 1e-5
    for res in got:  # SP really ran: its raw collectives are gloo's own, on megatron's TP group
        assert (res["recomputed"] > 0) == recompute
        calls = res["calls"]
        used = {(tag, fname) for tag, fname, _, _ in calls}
        assert ("layers.dist_all_gather_func", "all_gather_into_tensor") in used
        assert ("layers.dist_reduce_scatter_func", "reduce_scatter_tensor") in used
        assert ("mappings.dist_reduce_scatter_func", "reduce_scatter_tensor") in used  # embedding, row-parallel
        assert ("mappings.dist_all_gather_func", "all_gather_into_tensor") in used  # before the output layer
        assert all(on_tp for _, _, on_tp, _ in calls)


def test_pp2_tp2_sequence_parallel_matches_tp1(run_dist, sp_hf_dir, tp1_reference):
    """PP=2 x TP=2 + SP (1F1B, 4 ranks, tied embedding split across stages) equals TP=1."""
    got = run_dist(_sp_fwd_bwd, 4, str(sp_hf_dir), 2, 2, True, {}, False, timeout=180)
    logits_diff, lp_diff, grad_diff = _max_diffs(tp1_reference, got, 2)
    print(f"PP2xTP2+SP: max|dlogits|={logits_diff:.2e} max|dlp|={lp_diff:.2e} max rel|dgrad|={grad_diff:.2e}")
    assert logits_diff < 1e-5 and lp_diff < 1e-5 and grad_diff < 1e-5
