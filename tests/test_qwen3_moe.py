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

from convert_helpers import CONFIGS, hf_config_dict, hf_logits, make_hf_model, read_safetensors_dir  # noqa: E402

from megatron_bapo.models.registry import model_args_from_hf  # noqa: E402

MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", **CONFIGS["qwen3_moe"][1])
IDS = torch.tensor([[5, 17, 3, 42, 8, 99, 1, 60, 23, 7, 11, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 50, 51]])


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
