"""Fast batched decoding of short answers with a plain HF causal LM, for SFT stopping and base accuracy.

Why not `model.generate`: prompts here are a handful of characters and answers at most a few tokens,
so grouping prompts by token length (no padding, no position-id bookkeeping) and recomputing the full
forward per new token is simpler and fast enough (a 500-problem eval takes well under a second per
decoded token on 2 cores for the ~0.6M-parameter tiny model).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch

from megatron_bapo.rewards.arithmetic import arithmetic_reward


@torch.inference_mode()
def generate_answers(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 6,
    temperature: float = 0.0,
    generator: Optional[torch.Generator] = None,
    batch_size: int = 512,
) -> list[str]:
    """Decoded continuations (special tokens removed, cut at EOS) for raw-text `prompts`, in order.

    temperature 0 is greedy; otherwise samples from softmax(logits / temperature) over the full vocabulary
    with `generator`. The model is put in eval mode and restored to its previous mode.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    by_length: dict[int, list[int]] = defaultdict(list)
    encoded = [tokenizer.encode(p) for p in prompts]
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    outputs: list[str] = [""] * len(prompts)
    try:
        for indices in by_length.values():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long)
                done = torch.zeros(len(chunk), dtype=torch.bool)
                new_tokens = []
                for _ in range(max_new_tokens):
                    logits = model(input_ids=ids).logits[:, -1, :].float()
                    if temperature == 0:
                        nxt = logits.argmax(dim=-1)
                    else:
                        probs = torch.softmax(logits / temperature, dim=-1)
                        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                    nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                    new_tokens.append(nxt)
                    done |= nxt == eos
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                    if bool(done.all()):
                        break
                generated = torch.stack(new_tokens, dim=1).tolist()
                for row, i in zip(generated, chunk):
                    row = row[: row.index(eos)] if eos in row else row
                    outputs[i] = tokenizer.decode(row, skip_special_tokens=True)
    finally:
        model.train(was_training)
    return outputs


def answer_accuracy(
    model: torch.nn.Module,
    tokenizer,
    rows: Sequence[dict],
    *,
    temperature: float = 0.0,
    seed: int = 0,
    max_new_tokens: int = 6,
) -> float:
    """Mean `arithmetic_reward` over dataset rows `{"prompt", "answer"}` (greedy when temperature is 0)."""
    if not rows:
        raise ValueError("answer_accuracy needs at least one row")
    generator = torch.Generator().manual_seed(seed)
    responses = generate_answers(
        model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=max_new_tokens,
        temperature=temperature, generator=generator,
    )
    return sum(arithmetic_reward(resp, r["answer"]) for resp, r in zip(responses, rows)) / len(rows)
