"""Qwen3 dense (`Qwen3ForCausalLM`): Llama layout without biases plus a per-head RMSNorm on queries
and keys (`self_attn.q_norm` / `k_norm`, one `head_dim` weight each, replicated over TP: megatron's
`self_attention.q_layernorm` / `k_layernorm`, the same name in the local and the TE spec). The QKV
fusion uses the config's `head_dim` (32B: 64 x 128 query dims on a 5120 hidden size). Tied head for
0.6B-4B, untied for 8B and up."""

from megatron_bapo.convert.families.llama_like import llama_like_rules
from megatron_bapo.convert.mapping import ModelMapping

QWEN3 = ModelMapping("Qwen3ForCausalLM", llama_like_rules(qkv_bias=False, qk_norm=True))
