"""Qwen3 dense below the trainer: the registry's fields and refusals, the per-head q/k norms in the layer
specs, TP/SP/PP invariance on gloo ranks (log-probs, loss, gradient norm, the q/k norms' update), and the
offline conversion round trip. (HF vs megatron logits and the live round trip are in test_convert.py,
the parameter counts in test_plan.py, the trainer CLI in test_recipe.py.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from convert_helpers import CONFIGS, IDS, hf_config_dict, hf_logits, make_hf_model  # noqa: E402
from test_actor_parallel import _step  # noqa: E402

from megatron_bapo.models.registry import model_args_from_hf  # noqa: E402

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **CONFIGS["qwen3_untied"][1])


def test_registry_maps_qwen3_fields_from_a_dict_and_a_transformers_config():
    from transformers import Qwen3Config

    hf = Qwen3Config(**{k: v for k, v in QWEN3.items() if k not in ("model_type", "architectures")})
    for cfg in (QWEN3, hf):
        args = model_args_from_hf(cfg)
        ck, gk = args.config_kwargs, args.gpt_kwargs
        assert args.architecture == "Qwen3ForCausalLM"
        assert ck["qk_layernorm"] is True and ck["add_qkv_bias"] is False and ck["add_bias_linear"] is False
        assert ck["kv_channels"] == 24 != ck["hidden_size"] // ck["num_attention_heads"]  # explicit head_dim
        assert ck["num_query_groups"] == 2 and ck["layernorm_epsilon"] == 1e-6
        assert gk["rotary_base"] == 1e6 and gk["share_embeddings_and_output_weights"] is False
    assert model_args_from_hf({**QWEN3, "tie_word_embeddings": True}).gpt_kwargs["share_embeddings_and_output_weights"]
    assert "qk_layernorm" not in model_args_from_hf({**QWEN3, "architectures": ["Qwen2ForCausalLM"]}).config_kwargs


@pytest.mark.parametrize(
    "change, match",
    [
        ({"attention_bias": True}, "Qwen3ForCausalLM: attention_bias=True"),
        ({"use_sliding_window": True}, "Qwen3ForCausalLM: use_sliding_window=True"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"non-full attention at layers \[1\]"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
         "Qwen3ForCausalLM: rope type 'yarn'"),
    ],
)
def test_registry_refuses_what_it_would_not_reproduce(change, match):
    with pytest.raises(ValueError, match=match):
        model_args_from_hf({**QWEN3, **change})


def test_layer_specs_get_q_and_k_norms_from_the_config():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_bapo.models.layer_spec import SpTorchNorm, get_layer_spec, spec_options

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=24, qk_layernorm=True,
                            normalization="RMSNorm", use_cpu_initialization=True)
    assert spec_options(cfg) == {"qk_layernorm": True, "num_experts": None, "moe_grouped_gemm": False}
    attn = get_layer_spec(use_te=False, **spec_options(cfg)).submodules.self_attention.submodules
    assert attn.q_layernorm is SpTorchNorm and attn.k_layernorm is SpTorchNorm
    norm = SpTorchNorm(cfg, cfg.kv_channels, eps=1e-6)  # as SelfAttention builds it: one head_dim weight
    assert type(norm) is torch.nn.RMSNorm and tuple(norm.weight.shape) == (24,)
    plain = get_layer_spec(use_te=False).submodules.self_attention.submodules
    assert plain.q_layernorm is IdentityOp and plain.k_layernorm is IdentityOp


# --------------------------------------------------------------------------- invariance on gloo ranks
@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    """Random tiny Qwen3 checkpoints (random q/k norm weights, head_dim 24 on hidden 64), tied and untied."""
    root = tmp_path_factory.mktemp("qwen3")
    return {name: str(make_hf_model(f"qwen3_{name}", root / name, seed=7)) for name in ("tied", "untied")}


@pytest.fixture(scope="module")
def references(qwen3_dirs):
    from dist_harness import run_dist

    return {name: run_dist(_step, 1, d, {}, timeout=120)[0] for name, d in qwen3_dirs.items()}


METRICS = ("actor/loss", "actor/grad_norm", "actor/entropy", "actor/kl_k1", "bapo/c_high", "bapo/c_low",
           "actor/clipfrac", "actor/num_loss_tokens")


def _qk_norm_updates(result) -> dict[str, torch.Tensor]:
    return {k: v for k, v in result["update"].items() if "q_layernorm" in k or "k_layernorm" in k}


@pytest.mark.parametrize(
    "model, layout",
    [pytest.param("untied", {"tp": 2}, marks=pytest.mark.slow), ("untied", {"tp": 2, "sp": True}),
     pytest.param("untied", {"pp": 2}, marks=pytest.mark.slow), ("tied", {"pp": 2})],  # inner loop: TP+SP, tied PP
    ids=["untied-tp2", "untied-tp2-sp", "untied-pp2", "tied-pp2"],
)
def test_tp_and_pp_equal_one_process(run_dist, qwen3_dirs, references, model, layout):
    """Log-probs at temperature 0.6, loss, gradient norm and the log-probs after an SGD step equal one
    process; under TP the replicated q/k norm weights (whose gradients megatron all-reduces over TP:
    each rank normalises only its own heads) get the single-process update on every rank."""
    ref = references[model]
    results = run_dist(_step, 2, qwen3_dirs[model], layout, timeout=240)
    for got in results:  # fp32 noise only: 4e-6 at most here (these random weights give log-probs down to ~-10)
        torch.testing.assert_close(got["lp"], ref["lp"], atol=1e-5, rtol=0)
        for k in METRICS:
            assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=1e-6), k
        torch.testing.assert_close(got["lp_after"], ref["lp_after"], atol=1e-5, rtol=0)
    assert (ref["lp_after"] - ref["lp"]).abs().max() > 1e-3  # the SGD step changed the model
    ref_qk = _qk_norm_updates(ref)
    assert len(ref_qk) == 4 and min(u.abs().max() for u in ref_qk.values()) > 1e-6  # 2 layers x (q, k), moved
    if "tp" in layout:
        for got in results:
            for name, upd in _qk_norm_updates(got).items():
                torch.testing.assert_close(upd, ref_qk[name], atol=1e-7, rtol=1e-5, msg=name)


# --------------------------------------------------------------------------- offline conversion
def test_offline_round_trip_is_bit_exact_and_loads_at_tp2(tmp_path, run_dist):
    from convert_helpers import read_safetensors_dir
    from test_convert_offline import _actor_loads_converted, _to_megatron

    hf_dir = make_hf_model("qwen3_untied", tmp_path / "hf", seed=4)
    mdir, back = tmp_path / "mg", tmp_path / "back"
    run_dist(_to_megatron, 1, hf_dir, mdir, back, timeout=120)
    src, dst = read_safetensors_dir(hf_dir), read_safetensors_dir(back)
    assert sorted(src) == sorted(dst) and "model.layers.1.self_attn.k_norm.weight" in dst
    for k in src:
        assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), k
    ref = hf_logits(hf_dir, IDS)
    for logits in run_dist(_actor_loads_converted, 2, hf_dir, mdir, timeout=120):
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- GPU: Transformer Engine spec
@pytest.mark.gpu
def test_te_spec_qk_norms_match_hf_on_gpu(tmp_path):
    """The TE spec builds TE's norm for q/k (megatron's `qk_layernorm`) and its logits match HF's. fp32
    weights, but TE's GEMMs may run in TF32: the tolerance catches mapping errors (order-1 differences),
    not rounding."""
    import os

    from dist_harness import free_port

    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.layer_spec import have_transformer_engine
    from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

    if not have_transformer_engine():
        pytest.skip("Transformer Engine is not installed")
    hf_dir = make_hf_model("qwen3_untied", tmp_path / "hf", seed=5)
    cfg = hf_config_dict(hf_dir)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    try:
        initialize_model_parallel(ParallelConfig(backend="nccl"), seed=1)
        model = build_gpt_model(cfg, use_te=True)
        load_hf_into_model([model], hf_dir)
        norm = type(model.decoder.layers[0].self_attention.q_layernorm).__name__
        ids = IDS.cuda()
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        model.eval()
        with torch.no_grad():
            logits = model(ids, pos, None)[..., : cfg["vocab_size"]].float().cpu()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    assert "Norm" in norm and norm != "IdentityOp", norm
    torch.testing.assert_close(logits, hf_logits(hf_dir, IDS), atol=5e-2, rtol=0)
