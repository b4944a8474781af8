"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama layout plus q/k/v biases; tied or untied head."""

from megatron_bapo.convert.families.llama_like import llama_like_rules
from megatron_bapo.convert.mapping import ModelMapping

QWEN2 = ModelMapping("Qwen2ForCausalLM", llama_like_rules(qkv_bias=True))
