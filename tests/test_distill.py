"""On-policy distillation's advantage (`algorithms.distill`) against numbers computed by hand, through
`experience.build_experience` with real samples (token alignment, a tool's tokens masked, the reward's
advantage weighted); the settings that cannot work as meant refused at load; the teacher's log-probs
kept with a sample across a checkpoint's rollout state."""

from __future__ import annotations

import pytest
import torch

from megatron_bapo.algorithms.distill import DistillConfig
from megatron_bapo.config import AdvantageConfig, load_run_config
from megatron_bapo.config_io import ConfigError
from megatron_bapo.experience import build_experience
from megatron_bapo.rollout.types import AgentState, Prompt, RolloutGroup, Sample, SampleState
from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer

TINY = "examples/configs/tiny_bapo.yaml"


def _group() -> RolloutGroup:
    """Two samples of one prompt [1, 2]: A (reward 1) samples [3, 4, 5]; B (reward 0) samples 6, then a
    tool writes [7, 8] (span [1, 3): log-prob 0 placeholders), then it samples 9."""
    a = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], response_logprobs=[-0.5, -1.0, -2.0],
               response_versions=[0, 0, 0], state=SampleState.COMPLETED, reward=1.0,
               teacher_logprobs=[-0.25, -1.5, -2.0])
    b = Sample(prompt_ids=[1, 2], response_ids=[6, 7, 8, 9], response_logprobs=[-1.0, 0.0, 0.0, -0.1],
               response_versions=[0, -1, -1, 0], state=SampleState.COMPLETED, reward=0.0,
               teacher_logprobs=[-3.0, -0.2, -0.4, -0.1], agent=AgentState(tool_spans=[[1, 3]]))
    return RolloutGroup("g", Prompt([1, 2]), [a, b], 0)


def test_the_distill_advantage_equals_the_hand_computed_one():
    tok = build_tiny_tokenizer()
    # dr_grpo: reward advantages r - mean = +0.5 (A), -0.5 (B).
    # A = -(log pi_old - log pi_teacher) * coef + A_reward * reward_coef, coef 2, reward_coef 0.5:
    #   A: -(-0.5 + 0.25) * 2 + 0.25 = 0.75;  -(-1.0 + 1.5) * 2 + 0.25 = -0.75;  0 + 0.25 = 0.25
    #   B: -(-1.0 + 3.0) * 2 - 0.25 = -4.25;  tool tokens 0, 0;  -(-0.1 + 0.1) * 2 - 0.25 = -0.25
    batch, metrics = build_experience([_group()], tok, AdvantageConfig(estimator="dr_grpo"),
                                      distill=DistillConfig(coef=2.0, reward_coef=0.5))
    assert batch["advantages"].tolist() == [[0.0, 0.0, 0.75, -0.75, 0.25, 0.0],
                                            [0.0, 0.0, -4.25, 0.0, 0.0, -0.25]]
    # gaps log pi_old - log pi_teacher on the 5 trained tokens: -0.25, 0.5, 0, 2, 0 -> mean 0.45; 2 of 5 positive
    assert metrics["distill/reverse_kl_mean"] == pytest.approx(0.45)
    assert metrics["distill/frac_positive_advantage"] == pytest.approx(0.4)
    assert metrics["distill/num_tokens"] == 5.0
    # Pure distillation (reward_coef 0): the teacher's signal alone, coef 1.
    batch, _ = build_experience([_group()], tok, AdvantageConfig(estimator="dr_grpo"), distill=DistillConfig())
    assert batch["advantages"].tolist() == [[0.0, 0.0, 0.25, -0.5, 0.0, 0.0],
                                            [0.0, 0.0, -2.0, 0.0, 0.0, 0.0]]
    # Without a teacher: the reward's advantage on every sampled token, as before.
    batch, metrics = build_experience([_group()], tok, AdvantageConfig(estimator="dr_grpo"))
    assert batch["advantages"].tolist() == [[0.0, 0.0, 0.5, 0.5, 0.5, 0.0], [0.0, 0.0, -0.5, 0.0, 0.0, -0.5]]
    assert not any(k.startswith("distill/") for k in metrics)


def test_a_sample_without_teacher_log_probs_is_never_trained_as_zero():
    group = _group()
    group.samples[1].teacher_logprobs = None
    with pytest.raises(ValueError, match="sample 1 has no teacher log-probs for 4 response tokens"):
        build_experience([group], build_tiny_tokenizer(), AdvantageConfig(), distill=DistillConfig())
    group.samples[1].teacher_logprobs = [-1.0]
    with pytest.raises(ValueError, match="sample 1 has 1 teacher log-probs for 4 response tokens"):
        build_experience([group], build_tiny_tokenizer(), AdvantageConfig(), distill=DistillConfig())


def test_distill_settings_are_checked_at_load():
    cfg = load_run_config(TINY, ["teacher.model_path=/m/teacher", "distill.coef=0.5", "distill.reward_coef=1",
                                 "rollout.group_size=1", "actor.n_minibatches=1"])
    assert (cfg.distill.coef, cfg.distill.reward_coef, cfg.rollout.group_size) == (0.5, 1.0, 1)  # no group needed
    assert load_run_config(TINY).distill == DistillConfig()
    for overrides, needle in [
        (["distill.coef=2"], "distill is set (DistillConfig(coef=2.0, reward_coef=0.0)) but the run has no teacher"),
        (["teacher.model_path=/m", "distill.coef=0"], "distill.coef=0 with a teacher"),
        (["teacher.model_path=/m", "distill.reward_coef=-1"], "distill.reward_coef must be a finite number >= 0"),
        (["teacher.model_path=/m", "rollout.sampling.temperature=0.7"], "rollout.sampling.temperature=0.7 with a "
                                                                        "teacher"),
        (["teacher.model_path=/m", "rollout.dynamic_sampling=filter"], "rollout.dynamic_sampling=filter with "
                                                                       "distill.reward_coef=0"),
        (["rollout.group_size=1", "actor.n_minibatches=1"], "rollout.group_size=1: group-relative advantages"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_run_config(TINY, overrides)
        assert needle in str(err.value), str(err.value)
    load_run_config(TINY, ["teacher.model_path=/m", "distill.reward_coef=1", "rollout.dynamic_sampling=filter"])


def test_teacher_log_probs_survive_a_checkpoints_rollout_state(tmp_path):
    from megatron_bapo.rollout.state_tokens import TokenFile, save_tokens

    group = _group()
    group.samples[1].teacher_logprobs = None  # not scored yet: stays None
    state = save_tokens({"rollout": {"buffer": [group.to_dict()]}}, tmp_path)
    loaded = TokenFile.open(state, tmp_path).load()
    back = RolloutGroup.from_dict(loaded["rollout"]["buffer"][0])
    assert back.samples[0].teacher_logprobs == [-0.25, -1.5, -2.0] and back.samples[1].teacher_logprobs is None
    back.samples[0].reset()
    assert back.samples[0].teacher_logprobs is None  # regenerated from scratch: scored again when it finishes
    assert torch.tensor(back.samples[0].response_ids).numel() == 0
