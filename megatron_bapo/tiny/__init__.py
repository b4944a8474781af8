"""The tiny default: a char-level tokenizer, a random small Qwen2/Qwen3/Llama checkpoint, a synthetic
verifiable arithmetic task and a short SFT warm start, so the whole RL stack runs on one CPU machine.

Modules are imported on demand (`megatron_bapo.tiny.checkpoint`, `.tokenizer`, `.task`, `.sft`) so
that importing the package stays cheap.
"""
