"""megatron_bapo: BAPO reinforcement learning on megatron-core actors with SGLang rollouts.

Package map (one home per concern, data flows one way; see docs/design.md):
  algorithms/  pure torch: BAPO bound search, policy loss, advantages (no Megatron import)
  models/      HF config -> megatron-core GPTModel, layer specs, CPU compatibility
  actor/       Megatron actor: log-probs/entropy, train step, optimizer, checkpoints
  rollout/     SGLang client, group sampling, partial-rollout buffer
  server/      built-in CPU rollout server speaking SGLang's native HTTP API
  rewards/     answer verification and task rewards
  data/        prompt datasets and templates
  convert/     HF <-> Megatron weight mapping
"""

__version__ = "0.1.0"
