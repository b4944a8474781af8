"""Group-relative advantages (GRPO and Dr. GRPO).

Rewards arrive prompt-major: the `group_size` samples of prompt 0, then those of prompt 1, ...
(the order the rollout produces groups in). Advantages are per sequence; the trainer broadcasts
them over each response's tokens.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """`(r - mean_group) / (std_group + eps)`, or `r - mean_group` without std normalisation.

    Args:
        rewards: `[num_groups * group_size]` scalar rewards, prompt-major.
        group_size: G, samples per prompt (>= 1).
        normalize_std: divide by the group's standard deviation (GRPO); False is Dr. GRPO, which
            removes the std division because it up-weights near-deterministic prompts.
        eps: added to the std; groups with equal rewards get advantage 0 either way.

    The std is the unbiased sample std (as verl and TRL compute it); a group of one has std 0.
    Returns float32 `[num_groups * group_size]`.
    """
    if group_size < 1:
        raise ValueError(f"grpo_advantages: group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"grpo_advantages: rewards must be 1-D with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("grpo_advantages: rewards contain NaN/inf; check the reward function's output")
    grouped = rewards.detach().to(torch.float64).view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centered[:, :1])
        centered = centered / (std + eps)
    return centered.reshape(-1).to(torch.float32)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: group-mean baseline without std division (pair with a seq-mean-token-sum loss)."""
    return grpo_advantages(rewards, group_size, normalize_std=False)


def uniform_group_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[num_groups]` bool, True where every reward of the group is equal (zero advantage: no signal).

    Counted per trained batch (`experience/num_zero_variance_groups`); `rollout.dynamic_sampling` drops them.
    """
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)
