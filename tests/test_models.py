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
        ({"architectures": ["MistralForCausalLM"]}, "supported: \\['LlamaForCausalLM', 'Qwen2ForCausalLM'\\]"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ],
)
def test_registry_rejects_what_it_cannot_reproduce(change, match):
    with pytest.raises(ValueError, match=match):
        model_args_from_hf({**TINY_QWEN2, **change})
    assert supported_architectures() == ["LlamaForCausalLM", "Qwen2ForCausalLM"]


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
