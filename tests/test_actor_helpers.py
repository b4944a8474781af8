"""Shared helpers for the actor tests (tiny configs, synthetic batches, weight snapshots)."""

from __future__ import annotations

import torch

TINY_QWEN2 = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2, vocab_size=100, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=256,
)
TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2, vocab_size=120, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=256,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)


def make_batch(num_seqs: int = 8, max_len: int = 24, vocab: int = 100, seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded RL batch with random prompts/responses, behavior log-probs near the truth."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (num_seqs, max_len), generator=g)
    lengths = torch.randint(max_len // 2, max_len + 1, (num_seqs,), generator=g)
    prompt = torch.randint(3, max_len // 2, (num_seqs,), generator=g)
    t = torch.arange(max_len).unsqueeze(0)
    attn = (t < lengths.unsqueeze(1)).long()
    ids = ids * attn
    loss_mask = ((t >= prompt.unsqueeze(1)) & (attn > 0)).float()
    behavior = -torch.rand(num_seqs, max_len, generator=g) * 3.0 - 3.0
    adv = torch.randn(num_seqs, 1, generator=g).expand(-1, max_len).contiguous()
    return dict(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, behavior_logprobs=behavior, advantages=adv)


def full_params(actor) -> dict[str, torch.Tensor]:
    """This rank's parameters by name (copies)."""
    out = {}
    for i, chunk in enumerate(actor.model):
        for n, p in chunk.named_parameters():
            out[f"{i}.{n}"] = p.detach().clone()
    return out
