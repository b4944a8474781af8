"""Finished rollout groups -> rewards (`score_groups`) -> the actor's batch (`build_experience`).

Design section 3 steps 4-5, on the driver rank only. Rewards are computed once per sample, when its
group finishes, by `score_groups`: the rollout producer calls it (`rollout.dynamic_sampling` needs
each group's rewards before it decides what to train), and the reward rides on the sample
(`Sample.reward`, checkpointed with it) to `build_experience`, which turns the groups the step
trains into advantages and tensors. Rows are prompt-major (the G samples of a group are adjacent),
right-padded, and every per-token tensor is aligned to the token: the value at `[b, t]` concerns
`input_ids[b, t]`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from megatron_bapo.algorithms import dr_grpo_advantages, grpo_advantages, uniform_group_mask
from megatron_bapo.algorithms.distill import DistillConfig, distill_advantages, distill_metrics
from megatron_bapo.rewards import BatchScores, score_batch
from megatron_bapo.rewards.judge import METRIC as JUDGE_METRIC, judge_counts, lost_groups
from megatron_bapo.rewards.overlong import overlong_penalty
from megatron_bapo.rewards.types import REWARD_FN_FAILURES
from megatron_bapo.rollout.batch import build_batch

logger = logging.getLogger(__name__)


class RewardFailure(RuntimeError):
    """The reward function failed on too many responses of a step (reward.max_failure_rate)."""


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str, eps: float) -> torch.Tensor:
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards, group_size)
    return grpo_advantages(rewards, group_size, normalize_std=True, eps=eps)


@dataclass
class RewardStats:
    """What `score_groups` measured, summable over the calls of one step (`add`), then `metrics()`."""

    rewards: list[float] = field(default_factory=list)
    """The rewards training sees (task reward + overlong penalty), per sample (not of dropped groups)."""
    task_rewards: list[float] = field(default_factory=list)
    """The reward function's scores (accuracy counts those >= 1)."""
    penalties: list[float] = field(default_factory=list)
    num_failed: int = 0
    num_fn_failures: int = 0
    seconds: float = 0.0
    judge_counts: Optional[dict[str, int]] = None
    """The judge's verdicts by reason (`rewards.judge.METRIC`); None when no judge scored."""
    dropped_group_ids: list[str] = field(default_factory=list)
    """Groups not to train: a judge verdict is missing and `reward.judge.on_failure` is drop_group
    (the rollout's `DynamicSampler` drops them, as it drops groups without signal)."""

    def add(self, other: "RewardStats") -> None:
        self.rewards += other.rewards
        self.task_rewards += other.task_rewards
        self.penalties += other.penalties
        self.num_failed += other.num_failed
        self.num_fn_failures += other.num_fn_failures
        self.seconds += other.seconds
        if other.judge_counts is not None:
            mine = self.judge_counts or {}
            self.judge_counts = {k: mine.get(k, 0) + v for k, v in other.judge_counts.items()}
        self.dropped_group_ids += other.dropped_group_ids

    def metrics(self) -> dict[str, float]:
        """`rollout/reward_*`, `rollout/accuracy`, `reward/*` over every sample scored (none: counts
        only); with a judge, `judge/num_<reason>` and `judge/num_groups_dropped`."""
        out = {"reward/num_failed": float(self.num_failed), "reward/num_fn_failures": float(self.num_fn_failures),
               "timing/reward_s": self.seconds}
        if self.judge_counts is not None:
            out.update({JUDGE_METRIC[reason]: float(n) for reason, n in self.judge_counts.items()})
            out["judge/num_groups_dropped"] = float(len(self.dropped_group_ids))
        if self.rewards:
            rewards = torch.tensor(self.rewards, dtype=torch.float64)
            out.update({
                "rollout/reward_mean": float(rewards.mean()),
                "rollout/reward_std": float(rewards.std(unbiased=False)),
                "rollout/accuracy": sum(r >= 1.0 for r in self.task_rewards) / len(self.task_rewards),
                "reward/overlong_penalty_mean": sum(self.penalties) / len(self.penalties),
                "reward/num_overlong_penalized": float(sum(p < 0 for p in self.penalties)),
            })
        return out


def score_groups(groups: Sequence[Any], tokenizer: Any, reward_cfg: Any, *, max_response_tokens: int,
                 judge: Any = None) -> RewardStats:
    """Score every sample of `groups` (finished `RolloutGroup`s) and store its reward on it.

    `sample.reward` = the reward function's score of the decoded response + DAPO's overlong penalty
    (`reward.overlong_buffer_tokens` over `max_response_tokens`; `rewards.overlong`). With `judge`
    (a `rewards.judge.JudgeReward`: `reward.fn: judge`) the judge servers score instead, reading the
    prompt too (decoded without special tokens); a missing verdict scores 0, and under
    `reward.judge.on_failure: drop_group` its group is named in `dropped_group_ids` and left out of
    the reward means. Raises `RewardFailure` when the reward function (or the judge) failed on more
    than `reward.max_failure_rate` of the responses (a warning below that). Returns the statistics.
    """
    started = time.monotonic()
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return RewardStats()
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    answers = [g.prompt.answer for g in groups for _ in g.samples]
    group_ids = [g.group_id for g in groups for _ in g.samples]
    if judge is not None:
        prompts = {g.group_id: tokenizer.decode(g.prompt.prompt_ids, skip_special_tokens=True) for g in groups}
        scores = BatchScores(judge.score([prompts[gid] for gid in group_ids], texts, answers))
    else:
        scores = score_batch(reward_cfg.fn, texts, answers, num_workers=reward_cfg.num_workers, detailed=False,
                             timeout_s=reward_cfg.timeout_s)
    fn_failures = [r for r in scores.results if r.reward_fn_failed]
    if fn_failures:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(scores.failure_counts.items()) if k in REWARD_FN_FAILURES)
        examples = "; ".join(sorted({r.error or r.reason for r in fn_failures})[:3])
        message = (f"reward {reward_cfg.fn!r} failed on {len(fn_failures)} of {len(samples)} responses ({counts}); "
                   f"e.g. {examples}")
        if len(fn_failures) > reward_cfg.max_failure_rate * len(samples):
            fix = ("Check the judge servers (reward.judge.urls), reward.judge.parse_regex / parse_fn against these "
                   "verdicts and reward.judge.timeout_s" if judge is not None else "Fix reward.fn")
            raise RewardFailure(f"{message}. {fix} (a failure scores 0, so training on it would learn "
                                f"nothing), or raise reward.max_failure_rate={reward_cfg.max_failure_rate}")
        logger.warning(message)
    penalties = [overlong_penalty(s.response_length, max_response_tokens, reward_cfg.overlong_buffer_tokens,
                                  reward_cfg.overlong_penalty) for s in samples]
    for s, r, p in zip(samples, scores.rewards, penalties):
        s.reward = float(r) + p
    dropped = (lost_groups(scores.results, group_ids)
               if judge is not None and judge.config.on_failure == "drop_group" else set())
    kept = [i for i, gid in enumerate(group_ids) if gid not in dropped]
    return RewardStats(rewards=[samples[i].reward for i in kept], task_rewards=[float(scores.rewards[i]) for i in kept],
                       penalties=[penalties[i] for i in kept], num_failed=scores.num_failed,
                       num_fn_failures=len(fn_failures), seconds=time.monotonic() - started,
                       judge_counts=judge_counts(scores.results) if judge is not None else None,
                       dropped_group_ids=sorted(dropped))


def zero_variance(group: Any) -> bool:
    """Every sample of the (scored) group has the same reward: GRPO's advantages are all 0."""
    rewards = [s.reward for s in group.samples]
    return all(r == rewards[0] for r in rewards)


def build_experience(
    groups: Sequence[Any],
    tokenizer: Any,
    adv_cfg: Any,
    *,
    n_minibatches: int = 1,
    temperature: float = 1.0,
    routed_experts_shape: Optional[tuple[int, int]] = None,
    distill: Optional[DistillConfig] = None,
) -> tuple[Optional[dict[str, Any]], dict[str, float]]:
    """Advantages and tensors of the groups a step trains; returns (batch or None, `experience/*` metrics).

    `groups` are scored `RolloutGroup`s (`score_groups`: every sample has its `reward`), the ones
    `rollout.dynamic_sampling` kept. `temperature` is the sampling temperature of the rollouts; the
    batch carries it (`batch["temperature"]`) so the actor computes log-probs of the same
    distribution the behavior log-probs came from. `routed_experts_shape` (num_layers, top_k): the
    batch carries the samples' recorded MoE routing (`routed_experts`). `distill` (a run with a
    teacher): the advantages are per token, `algorithms.distill.distill_advantages` of the sampler's
    and the teacher's log-probs (`Sample.teacher_logprobs`) and the reward's advantage (`distill/*`
    metrics); None: the reward's advantage on every token of a response.
    """
    metrics: dict[str, float] = {"experience/num_groups": float(len(groups))}
    if not groups:
        metrics["experience/num_samples"] = 0.0
        return None, metrics
    group_size = len(groups[0].samples)
    if any(len(g.samples) != group_size for g in groups):
        raise ValueError(f"build_experience: groups of different sizes {sorted({len(g.samples) for g in groups})}")
    samples = [s for g in groups for s in g.samples]
    if any(s.reward is None for s in samples):
        raise ValueError("build_experience: a sample has no reward; score the groups first (experience.score_groups)")
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    advantages = group_advantages(rewards, group_size, adv_cfg.estimator, adv_cfg.eps)
    # Groups trained with advantage 0 on every token (0 under rollout.dynamic_sampling filter / refill).
    metrics["experience/num_zero_variance_groups"] = float(uniform_group_mask(rewards, group_size).sum())
    keep_rows = list(range(len(samples)))
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
    if distill is not None:
        teacher = _teacher_logprobs([samples[i] for i in keep_rows], batch["behavior_logprobs"])
        batch["advantages"] = distill_advantages(batch["behavior_logprobs"], teacher, batch["advantages"],
                                                 batch["loss_mask"], coef=distill.coef, reward_coef=distill.reward_coef)
        metrics.update(distill_metrics(batch["behavior_logprobs"], teacher, batch["advantages"], batch["loss_mask"]))
    return batch, metrics


def _teacher_logprobs(samples: Sequence[Any], like: torch.Tensor) -> torch.Tensor:
    """`[B, T]` float32, each sample's teacher log-probs at its response positions (0 elsewhere), aligned
    to the token as `build_batch`'s tensors."""
    out = torch.zeros_like(like, dtype=torch.float32)
    for b, s in enumerate(samples):
        values = s.teacher_logprobs
        if values is None or len(values) != len(s.response_ids):
            raise ValueError(f"build_experience: sample {b} has {'no' if values is None else len(values)} teacher "
                             f"log-probs for {len(s.response_ids)} response tokens (rollout.teacher.TeacherScorer)")
        p = len(s.prompt_ids)
        out[b, p:p + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out
