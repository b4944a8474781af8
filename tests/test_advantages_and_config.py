"""GRPO advantages and BapoConfig validation/presets."""

from __future__ import annotations

import pytest
import torch

from megatron_bapo.algorithms import PRESETS, BapoConfig, dr_grpo_advantages, grpo_advantages, uniform_group_mask


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # unbiased, 0.5774
    assert adv[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert grpo_advantages(rewards, 4)[4:].tolist() == [0.0] * 4  # equal rewards: no signal, no NaN
    assert dr_grpo_advantages(rewards, 4)[:4].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert uniform_group_mask(rewards, 4).tolist() == [False, True]


def test_grpo_advantages_errors():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), 2)
    assert grpo_advantages(torch.tensor([3.0]), 1).tolist() == [0.0]


def test_presets_match_design():
    assert BapoConfig.preset("bapo") == BapoConfig()
    paper = BapoConfig.preset("bapo-paper")
    assert (paper.contribution, paper.weight, paper.metric, paper.order) == ("surrogate", "rollout_prob", "printed", "paper")
    verl = BapoConfig.preset("bapo-verl")
    assert (verl.rho0, verl.low_start, verl.low_max, verl.high_max, verl.order) == (0.5, 0.8, 0.95, 2.0, "verl")
    assert not BapoConfig.preset("grpo").is_adaptive and BapoConfig.preset("bapo").is_adaptive
    assert BapoConfig.preset("clip-higher").high_start == 1.28
    assert set(PRESETS) == {"bapo", "bapo-paper", "bapo-verl", "grpo", "clip-higher"}
    assert BapoConfig().num_high_steps == 36 and BapoConfig().num_low_steps == 15


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(low_start=0.95), "low_start"),
        (dict(high_start=3.5), "high_start"),
        (dict(high_step=0.0), "high_step"),
        (dict(low_step=-0.02), "low_step"),
        (dict(rho0=1.5), "rho0"),
        (dict(rho0=float("nan")), "rho0"),
        (dict(contribution="grad"), "contribution"),
        (dict(weight="prob"), "weight"),
        (dict(metric="ratio"), "metric"),
        (dict(order="fast"), "order"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(low_max=1.3), "low_max"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BapoConfig(**kwargs)


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="bapo-verl"):
        BapoConfig.preset("ppo")
