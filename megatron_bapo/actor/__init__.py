"""Megatron actor: vocab-parallel log-probs/entropy, the BAPO train step, checkpoints."""
