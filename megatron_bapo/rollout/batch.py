"""Padded actor batch tensors from finished samples.

Everything is ALIGNED TO THE TOKEN: the value at `[b, t]` concerns token `input_ids[b, t]` (its
behavior log-prob is log p(input_ids[b, t] | input_ids[b, :t])), rows are right-padded, and
`loss_mask` is 1 exactly on the response tokens the policy sampled. A multi-turn sample's tool
tokens (`Sample.agent.tool_spans`) are context only: loss mask 0, behavior log-prob 0, version -1,
advantage 0, exactly as a prompt token, so the loss, the bound search, the importance corrections,
the mismatch and staleness metrics, which all read `loss_mask`, see only sampled tokens. This is
the layout `Actor.train_step` takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from megatron_bapo.rollout.types import Sample, SampleState

if TYPE_CHECKING:  # torch is imported on use: the client and the stand-in server do not need it
    import torch


def build_batch(
    samples: Sequence[Sample],
    *,
    pad_token_id: int = 0,
    advantages: Optional[Sequence[float] | torch.Tensor] = None,
    rewards: Optional[Sequence[float] | torch.Tensor] = None,
    pad_to_multiple_of: int = 1,
    routed_experts_shape: Optional[tuple[int, int]] = None,
) -> dict[str, torch.Tensor]:
    """Batch of `B = len(samples)` rows, `T` = longest prompt+response (rounded up to the multiple).

    Returns CPU tensors `[B, T]`:
      input_ids (long; pad_token_id on padding), attention_mask (long; 1 on prompt+response),
      loss_mask (float32; 1 on sampled response tokens, 0 on a tool's), behavior_logprobs (float32;
      0 off the sampled tokens), versions (long; policy version of each sampled token, -1 elsewhere),
      advantages (float32; the sample's scalar advantage on its response tokens, 0 elsewhere),
      only when `advantages` (one value per sample) is given;
    and `[B]`: prompt_lengths, response_lengths (long), truncated (bool: the response hit its token
    limit, `SampleState.TRUNCATED`), rewards (float32, when given).
    With `routed_experts_shape = (num_layers, top_k)` (a mixture of experts): routed_experts (int16
    `[B, T, num_layers, top_k]`, each sample's recorded routing at its positions, -1 where none).
    """
    import torch

    if not samples:
        raise ValueError("build_batch: no samples")
    if pad_to_multiple_of < 1:
        raise ValueError(f"build_batch: pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        if len(s.response_logprobs) != n or len(s.response_versions) != n:
            raise ValueError(f"sample {i}: {n} response ids but {len(s.response_logprobs)} log-probs and "
                             f"{len(s.response_versions)} versions")
    batch_size = len(samples)
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((batch_size, length), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    loss_mask = torch.zeros((batch_size, length), dtype=torch.float32)
    logprobs = torch.zeros((batch_size, length), dtype=torch.float32)
    versions = torch.full((batch_size, length), -1, dtype=torch.long)
    prompt_lengths = torch.zeros(batch_size, dtype=torch.long)
    response_lengths = torch.zeros(batch_size, dtype=torch.long)
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[b, :p] = torch.tensor(s.prompt_ids, dtype=torch.long)
        if r:
            input_ids[b, p:p + r] = torch.tensor(s.response_ids, dtype=torch.long)
            logprobs[b, p:p + r] = torch.tensor(s.response_logprobs, dtype=torch.float32)
            versions[b, p:p + r] = torch.tensor(s.response_versions, dtype=torch.long)
            loss_mask[b, p:p + r] = 1.0
            for start, end in (s.agent.tool_spans if s.agent else ()):  # a tool's tokens: context only
                loss_mask[b, p + start:p + end] = 0.0
                logprobs[b, p + start:p + end] = 0.0
                versions[b, p + start:p + end] = -1
        attention_mask[b, :p + r] = 1
        prompt_lengths[b], response_lengths[b] = p, r
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
           "behavior_logprobs": logprobs, "versions": versions, "prompt_lengths": prompt_lengths,
           "response_lengths": response_lengths,
           "truncated": torch.tensor([s.state is SampleState.TRUNCATED for s in samples], dtype=torch.bool)}
    if advantages is not None:
        adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if adv.numel() != batch_size:
            raise ValueError(f"build_batch: {adv.numel()} advantages for {batch_size} samples (one per sample)")
        out["advantages"] = adv[:, None] * loss_mask
    if routed_experts_shape is not None:
        out["routed_experts"] = _routed_experts(samples, length, routed_experts_shape)
    if rewards is not None:
        rew = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        if rew.numel() != batch_size:
            raise ValueError(f"build_batch: {rew.numel()} rewards for {batch_size} samples (one per sample)")
        out["rewards"] = rew
    return out


def _routed_experts(samples: Sequence[Sample], length: int, shape: tuple[int, int]) -> "torch.Tensor":
    import numpy as np
    import torch

    num_layers, top_k = shape
    out = torch.full((len(samples), length, num_layers, top_k), -1, dtype=torch.int16)
    for b, s in enumerate(samples):
        if not s.routed_rows:
            continue
        if s.routed_width != num_layers * top_k:
            raise ValueError(f"sample {b}: {s.routed_width} routed experts per position, the model has "
                             f"{num_layers} layers x top-{top_k}")
        rows = np.frombuffer(s.routed_experts, dtype="<i2").reshape(s.routed_rows, num_layers, top_k)
        if rows.shape[0] > len(s.prompt_ids) + len(s.response_ids):
            raise ValueError(f"sample {b}: routing for {rows.shape[0]} positions, it has "
                             f"{len(s.prompt_ids) + len(s.response_ids)} tokens")
        out[b, :rows.shape[0]] = torch.from_numpy(rows.copy())
    return out


def mask_stale_tokens(batch: dict[str, "torch.Tensor"], current_version: int,
                      max_staleness: Optional[int]) -> dict[str, float]:
    """Staleness judged per token at training time: response tokens generated more than
    `max_staleness` versions before `current_version` (the weights about to train them) leave the
    loss (`loss_mask` and `advantages` set to 0, in place). Everything downstream that reads the loss
    mask (aggregation, BAPO's bound search, the loss, the staleness metrics) then sees exactly the
    tokens that train. Returns `staleness/num_masked_tokens` and `staleness/frac_masked_tokens`."""
    loss = batch["loss_mask"] > 0
    total = int(loss.sum())
    if max_staleness is None:
        return {"staleness/num_masked_tokens": 0.0, "staleness/frac_masked_tokens": 0.0}
    stale = loss & (batch["versions"] < current_version - max_staleness)
    num = int(stale.sum())
    if num:
        batch["loss_mask"][stale] = 0.0
        if "advantages" in batch:
            batch["advantages"][stale] = 0.0
    return {"staleness/num_masked_tokens": float(num), "staleness/frac_masked_tokens": num / total if total else 0.0}
