"""Llama 2/3/3.x (`LlamaForCausalLM`): no biases; untied head (tied for Llama 3.2 1B/3B)."""

from megatron_bapo.convert.families.llama_like import llama_like_rules
from megatron_bapo.convert.mapping import ModelMapping

LLAMA = ModelMapping("LlamaForCausalLM", llama_like_rules(qkv_bias=False))
