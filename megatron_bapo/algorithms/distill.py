"""On-policy distillation: the teacher's log-probs of the student's own tokens as a per-token advantage.

The student samples; a teacher scores every sampled token (`rollout.teacher`: one prefill per
finished response). Each token's advantage is

    A[t] = -(log pi_old(y_t) - log pi_teacher(y_t)) * coef + A_reward * reward_coef

where log pi_old is the sampler's own log-prob of the token (the behavior log-prob the sample
records, per token: partial rollout keeps each segment's), log pi_teacher the teacher's, and A_reward
the group-relative advantage of the task reward (`advantage.estimator`), the same on every token of
a response. The first term is minus the per-token estimate of the reverse KL(pi_old || pi_teacher):
tokens the teacher finds likelier than the student did are pushed up, the others down, a dense
signal on every token instead of one number per response (Agarwal et al. 2024, GKD; Thinking
Machines' on-policy distillation; verl OPSD, miles OPD). It is trained by any `actor.policy_loss`
like any advantage: the ratios, the clip bounds and BAPO's balance (its positive share, logged as
`bapo/rho_*`) see per-token signs. Tokens off the loss mask (prompt, padding, a tool's result
tokens) get 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class DistillConfig:
    """`distill` in a run config: the weights of the teacher's signal and of the task reward. Acts only
    when the run has a teacher (`teacher.model_path`)."""

    coef: float = 1.0
    """Weight of the teacher's signal: every sampled token's advantage gets
    `-(log pi_old - log pi_teacher) x coef`."""
    reward_coef: float = 0.0
    """Weight of the task reward's group-relative advantage, added on every token of a response;
    0 = pure distillation (the reward is still computed and logged)."""

    def __post_init__(self) -> None:
        for name in ("coef", "reward_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"distill.{name} must be a finite number >= 0, got {value}")


def distill_advantages(behavior_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       reward_advantages: torch.Tensor, mask: torch.Tensor, *, coef: float,
                       reward_coef: float) -> torch.Tensor:
    """`mask * (-(behavior - teacher) * coef + reward_advantages * reward_coef)`, float32 `[B, T]`.

    All inputs `[B, T]`, aligned to the token (the value at `[b, t]` concerns `input_ids[b, t]`):
    `behavior_logprobs` the sampler's log-prob of each token, `teacher_logprobs` the teacher's,
    `reward_advantages` the reward's advantage broadcast over each response, `mask` 1 on the tokens
    that train (0 elsewhere: the result is exactly 0 there, whatever the other inputs hold).
    Computed in float64, returned as float32.
    """
    shapes = {t.shape for t in (behavior_logprobs, teacher_logprobs, reward_advantages, mask)}
    if len(shapes) != 1:
        raise ValueError(f"distill_advantages: inputs of different shapes {sorted(map(tuple, shapes))}")
    on = mask > 0
    gap = behavior_logprobs.double() - teacher_logprobs.double()
    adv = -gap * float(coef) + reward_advantages.double() * float(reward_coef)
    return torch.where(on, adv, torch.zeros_like(adv)).float()


def distill_metrics(behavior_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, float]:
    """`distill/*` over the tokens that train: the mean log-prob gap (the per-token reverse-KL estimate
    the advantage is built from), the teacher's mean log-prob, and the share of positive advantages."""
    on = mask > 0
    num = int(on.sum())
    if not num:
        return {"distill/num_tokens": 0.0}
    gap = (behavior_logprobs.double() - teacher_logprobs.double())[on]
    return {"distill/num_tokens": float(num), "distill/reverse_kl_mean": float(gap.mean()),
            "distill/teacher_logprob_mean": float(teacher_logprobs.double()[on].mean()),
            "distill/frac_positive_advantage": float((advantages[on] > 0).double().mean())}


def check_distill(config: DistillConfig, *, has_teacher: bool, temperature: float, dynamic_sampling: str) -> None:
    """Raise ValueError (naming the fields and the fix) for distillation settings that cannot work as meant."""
    if not has_teacher:
        if config != DistillConfig():
            raise ValueError(f"distill is set ({config}) but the run has no teacher: set teacher.model_path (the "
                             f"teacher's HF directory) or remove the distill section")
        return
    if config.coef == 0:
        raise ValueError("distill.coef=0 with a teacher: its log-probs would be computed and never used; set "
                         "distill.coef > 0 or remove the teacher section")
    if temperature != 1.0:
        raise ValueError(f"rollout.sampling.temperature={temperature} with a teacher: the teacher's prefill "
                         f"log-probs are of its temperature-1 distribution, the sampler's of the temperature-"
                         f"{temperature} one, so their difference is not the reverse KL; use temperature 1.0")
    if config.reward_coef == 0 and dynamic_sampling != "off":
        raise ValueError(f"rollout.dynamic_sampling={dynamic_sampling} with distill.reward_coef=0: groups would be "
                         f"dropped for equal rewards though the run trains on the teacher's signal, which they "
                         f"carry; set rollout.dynamic_sampling: off (or distill.reward_coef > 0)")
