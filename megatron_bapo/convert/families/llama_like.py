"""Rules shared by Llama-style decoders (RMSNorm, GQA attention, SwiGLU MLP, optional untied head).

Built from parts so that a family takes what it has: `attention_rules` with q/k/v biases (Qwen2)
or per-head q/k norms (Qwen3), and either the dense MLP here or its own (a mixture of experts keeps
the embedding, attention and head rules and brings its own `mlp` and `pre_mlp_layernorm` rules).
"""

from __future__ import annotations

from megatron_bapo.convert.mapping import TensorRule

L = "decoder.layers.{i}."
H = "model.layers.{i}."


def embedding_rules() -> list[TensorRule]:
    return [TensorRule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), "vocab")]


def attention_rules(*, qkv_bias: bool, qk_norm: bool) -> list[TensorRule]:
    """Input norm, fused QKV (+ bias), per-head q/k norms (replicated: one `head_dim` weight each), o_proj."""
    rules = [
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
    if qk_norm:
        rules += [
            TensorRule((L + "self_attention.q_layernorm.weight",), (H + "self_attn.q_norm.weight",), "replicated"),
            TensorRule((L + "self_attention.k_layernorm.weight",), (H + "self_attn.k_norm.weight",), "replicated"),
        ]
    rules.append(TensorRule((L + "self_attention.linear_proj.weight",), (H + "self_attn.o_proj.weight",), "row"))
    return rules


def dense_mlp_rules() -> list[TensorRule]:
    """The post-attention norm (fused into linear_fc1 by the TE spec) and the SwiGLU MLP."""
    return [
        TensorRule(
            (L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight"),
            (H + "post_attention_layernorm.weight",), "replicated",
        ),
        TensorRule((L + "mlp.linear_fc1.weight",), (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up"),
        TensorRule((L + "mlp.linear_fc2.weight",), (H + "mlp.down_proj.weight",), "row"),
    ]


def head_rules() -> list[TensorRule]:
    """Final norm and output layer (dropped from the HF side when embeddings are tied)."""
    return [
        TensorRule(("decoder.final_layernorm.weight",), ("model.norm.weight",), "replicated"),
        TensorRule(("output_layer.weight",), ("lm_head.weight",), "vocab"),
    ]


def llama_like_rules(*, qkv_bias: bool, qk_norm: bool = False) -> list[TensorRule]:
    """Every rule of a dense Llama-like family."""
    return embedding_rules() + attention_rules(qkv_bias=qkv_bias, qk_norm=qk_norm) + dense_mlp_rules() + head_rules()
