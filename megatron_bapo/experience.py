"""Finished rollout groups -> the actor's batch: rewards, group advantages, filtering, tensors.

Design section 3 steps 4-5. Runs on the driver rank only; the result is broadcast to the actor ranks.
Rows are prompt-major (the G samples of a group are adjacent), right-padded, and every per-token
tensor is aligned to the token: the value at `[b, t]` concerns `input_ids[b, t]`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from megatron_bapo.algorithms import dr_grpo_advantages, grpo_advantages, uniform_group_mask
from megatron_bapo.rewards import score_batch
from megatron_bapo.rewards.types import REWARD_FN_FAILURES
from megatron_bapo.rollout.batch import build_batch

logger = logging.getLogger(__name__)


class RewardFailure(RuntimeError):
    """The reward function failed on too many responses of a step (reward.max_failure_rate)."""


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str, eps: float) -> torch.Tensor:
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards, group_size)
    return grpo_advantages(rewards, group_size, normalize_std=True, eps=eps)


def build_experience(
    groups: Sequence[Any],
    tokenizer: Any,
    reward_cfg: Any,
    adv_cfg: Any,
    *,
    n_minibatches: int = 1,
    temperature: float = 1.0,
    routed_experts_shape: Optional[tuple[int, int]] = None,
) -> tuple[Optional[dict[str, Any]], dict[str, float]]:
    """Score, compute advantages, filter; returns (batch or None, `rollout/*` + `experience/*` metrics).

    `groups` are `megatron_bapo.rollout.RolloutGroup`s with all samples finished. The reward of each
    sample is stored on it (`sample.reward`) so callers can log or dump it. `temperature` is the
    sampling temperature of the rollouts; the batch carries it (`batch["temperature"]`) so the actor
    computes log-probs of the same distribution the behavior log-probs came from.
    `routed_experts_shape` (num_layers, top_k): the batch carries the samples' recorded MoE routing
    (`routed_experts`, for the actor's routing replay and `moe/*` metrics).
    """
    metrics: dict[str, float] = {"experience/num_groups": float(len(groups))}
    if not groups:
        return None, metrics
    group_size = len(groups[0].samples)
    if any(len(g.samples) != group_size for g in groups):
        raise ValueError(f"build_experience: groups of different sizes {sorted({len(g.samples) for g in groups})}")
    samples = [s for g in groups for s in g.samples]
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    answers = [g.prompt.answer for g in groups for _ in g.samples]
    scores = score_batch(reward_cfg.fn, texts, answers, num_workers=reward_cfg.num_workers, detailed=False,
                         timeout_s=reward_cfg.timeout_s)
    fn_failures = [r for r in scores.results if r.reward_fn_failed]
    if fn_failures:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(scores.failure_counts.items()) if k in REWARD_FN_FAILURES)
        examples = "; ".join(sorted({r.error or r.reason for r in fn_failures})[:3])
        message = (f"reward {reward_cfg.fn!r} failed on {len(fn_failures)} of {len(samples)} responses ({counts}); "
                   f"e.g. {examples}")
        if len(fn_failures) > reward_cfg.max_failure_rate * len(samples):
            raise RewardFailure(f"{message}. Fix reward.fn (a failure scores 0, so training on it would learn "
                                f"nothing), or raise reward.max_failure_rate={reward_cfg.max_failure_rate}")
        logger.warning(message)
    rewards = torch.tensor(scores.rewards, dtype=torch.float64)
    for s, r in zip(samples, scores.rewards):
        s.reward = float(r)
    metrics.update({
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std(unbiased=False)),
        "rollout/accuracy": float((rewards >= 1.0).double().mean()),
        "reward/num_failed": float(scores.num_failed),
        "reward/num_fn_failures": float(len(fn_failures)),
    })
    advantages = group_advantages(rewards, group_size, adv_cfg.estimator, adv_cfg.eps)
    uniform = uniform_group_mask(rewards, group_size)
    metrics["experience/uniform_group_frac"] = float(uniform.double().mean())
    keep_rows = list(range(len(samples)))
    if adv_cfg.filter_uniform_groups:
        keep_rows = [i for i in keep_rows if not bool(uniform[i // group_size])]
        metrics["experience/num_groups_filtered"] = float(uniform.sum())
    usable = len(keep_rows) - len(keep_rows) % n_minibatches
    if usable < len(keep_rows):
        # Mini-batches must be equal in size; drop whole trailing rows rather than pad with fakes.
        metrics["experience/num_samples_dropped_uneven"] = float(len(keep_rows) - usable)
        keep_rows = keep_rows[:usable]
    metrics["experience/num_samples"] = float(len(keep_rows))
    if not keep_rows:
        return None, metrics
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = build_batch([samples[i] for i in keep_rows], pad_token_id=pad_id,
                        advantages=[float(advantages[i]) for i in keep_rows],
                        rewards=[float(rewards[i]) for i in keep_rows], routed_experts_shape=routed_experts_shape)
    batch["temperature"] = float(temperature)
    return batch, metrics
