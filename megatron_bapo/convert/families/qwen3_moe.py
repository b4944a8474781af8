"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's embedding, attention (per-head q/k norms) and head, and a
mixture of experts in every layer instead of the dense MLP.

HF stores one set of tensors per expert (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`) and
the router as `mlp.gate.weight` `[num_experts, hidden]`; megatron-core's `MoELayer` has the router
as `mlp.router.weight` (same layout) and each expert as an MLP whose `linear_fc1` is `[gate; up]`
(`SequentialMLP.local_experts.{e}` in the local spec, `TEGroupedMLP` `linear_fc1.weight{e}` with
TE). The post-attention norm is megatron's `pre_mlp_layernorm` (a plain norm in both specs: TE
cannot fuse it into the experts). In `torch_dist` checkpoints the experts are
`decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight` with a layer and an expert axis
(the key both expert implementations write), so expert parallelism reshards on load.

Real Qwen3-MoE checkpoints are untied. A tied one is written with `lm_head.weight` too
(`write_tied_head`): SGLang 0.5.23's Qwen3-MoE ignores `tie_word_embeddings` and would serve it with a
zero output head.
"""

from megatron_bapo.convert.families.llama_like import H, L, attention_rules, embedding_rules, head_rules
from megatron_bapo.convert.mapping import ModelMapping, TensorRule

EXPERTS_KEY = "decoder.layers.mlp.experts.experts."


def moe_mlp_rules() -> list[TensorRule]:
    """The post-attention norm, the router and every expert's SwiGLU MLP."""
    return [
        TensorRule((L + "pre_mlp_layernorm.weight",), (H + "post_attention_layernorm.weight",), "replicated"),
        TensorRule((L + "mlp.router.weight",), (H + "mlp.gate.weight",), "replicated"),
        TensorRule(
            (L + "mlp.experts.local_experts.{e}.linear_fc1.weight", L + "mlp.experts.linear_fc1.weight{e}"),
            (H + "mlp.experts.{e}.gate_proj.weight", H + "mlp.experts.{e}.up_proj.weight"), "gate_up",
            checkpoint_key=EXPERTS_KEY + "linear_fc1.weight",
        ),
        TensorRule(
            (L + "mlp.experts.local_experts.{e}.linear_fc2.weight", L + "mlp.experts.linear_fc2.weight{e}"),
            (H + "mlp.experts.{e}.down_proj.weight",), "row",
            checkpoint_key=EXPERTS_KEY + "linear_fc2.weight",
        ),
    ]


QWEN3_MOE = ModelMapping(
    "Qwen3MoeForCausalLM",
    embedding_rules() + attention_rules(qkv_bias=False, qk_norm=True) + moe_mlp_rules() + head_rules(),
    write_tied_head=True,
)
