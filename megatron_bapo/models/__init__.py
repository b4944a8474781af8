"""HF config -> megatron-core GPTModel: registry, layer specs, parallel state, CPU compatibility."""
