"""Rules shared by Llama-style decoders (RMSNorm, GQA attention, SwiGLU MLP, optional untied head)."""

from __future__ import annotations

from megatron_bapo.convert.mapping import TensorRule

L = "decoder.layers.{i}."
H = "model.layers.{i}."


def llama_like_rules(*, qkv_bias: bool) -> list[TensorRule]:
    """Rules for one Llama-like family; `qkv_bias` adds the q/k/v bias (Qwen2)."""
    rules = [
        TensorRule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), "vocab"),
        TensorRule(
            (L + "input_layernorm.weight", L + "self_attention.linear_qkv.layer_norm_weight"),
            (H + "input_layernorm.weight",), "replicated",
        ),
        TensorRule(
            (L + "self_attention.linear_qkv.weight",),
            (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"), "qkv",
        ),
    ]
    if qkv_bias:
        rules.append(TensorRule(
            (L + "self_attention.linear_qkv.bias",),
            (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"), "qkv",
        ))
    rules += [
        TensorRule((L + "self_attention.linear_proj.weight",), (H + "self_attn.o_proj.weight",), "row"),
        TensorRule(
            (L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight"),
            (H + "post_attention_layernorm.weight",), "replicated",
        ),
        TensorRule((L + "mlp.linear_fc1.weight",), (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up"),
        TensorRule((L + "mlp.linear_fc2.weight",), (H + "mlp.down_proj.weight",), "row"),
        TensorRule(("decoder.final_layernorm.weight",), ("model.norm.weight",), "replicated"),
        TensorRule(("output_layer.weight",), ("lm_head.weight",), "vocab"),
    ]
    return rules
