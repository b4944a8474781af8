"""Rollout groups -> rewards (score_groups, with DAPO's overlong penalty) -> actor batch: GRPO advantages, token alignment."""

import pytest
import torch
from transformers import AutoTokenizer

from megatron_bapo.config import AdvantageConfig, RewardConfig
from megatron_bapo.experience import build_experience, score_groups
from megatron_bapo.rollout.types import Prompt, RolloutGroup, Sample, SampleState


ARITH = RewardConfig(fn="arithmetic", num_workers=0)


def _scored(groups, tok, cfg=ARITH, max_response_tokens=64):
    stats = score_groups(groups, tok, cfg, max_response_tokens=max_response_tokens)
    return stats.metrics()


def _group(tok, gid, prompt, answer, responses, version=3):
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    samples = []
    for text in responses:
        r = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        samples.append(Sample(prompt_ids=ids, response_ids=r, response_logprobs=[-0.5 - i for i in range(len(r))],
                              response_versions=[version] * len(r), state=SampleState.COMPLETED, num_segments=1))
    return RolloutGroup(group_id=gid, prompt=Prompt(prompt_ids=ids, answer=answer), samples=samples, start_version=version)


@pytest.fixture(scope="module")
def tok(tiny_hf_dir):
    return AutoTokenizer.from_pretrained(tiny_hf_dir)


def test_rewards_advantages_and_alignment(tok):
    groups = [_group(tok, "a", "12+34=", "64", ["64", "65", "64", "1"]),
              _group(tok, "b", "5+5=", "01", ["01", "01", "01", "01"])]
    m = _scored(groups, tok)
    batch, _ = build_experience(groups, tok, AdvantageConfig())
    rewards = torch.tensor([s.reward for g in groups for s in g.samples])
    assert rewards.tolist() == [1, 0, 1, 0, 1, 1, 1, 1]
    assert m["rollout/accuracy"] == pytest.approx(6 / 8) and m["rollout/reward_mean"] == pytest.approx(6 / 8)
    # Independent reference: GRPO with unbiased std within each group.
    g0 = rewards[:4].double()
    ref0 = (g0 - g0.mean()) / (g0.std() + 1e-6)
    for row in range(8):
        s = groups[row // 4].samples[row % 4]
        p, n = len(s.prompt_ids), len(s.response_ids)
        assert batch["input_ids"][row, : p + n].tolist() == s.prompt_ids + s.response_ids
        assert batch["attention_mask"][row].sum() == p + n
        assert batch["loss_mask"][row].nonzero().flatten().tolist() == list(range(p, p + n))
        assert batch["behavior_logprobs"][row, p : p + n].tolist() == s.response_logprobs
        assert (batch["versions"][row, p : p + n] == 3).all() and (batch["versions"][row, :p] == -1).all()
        expected = float(ref0[row]) if row < 4 else 0.0
        assert batch["advantages"][row, p : p + n].tolist() == pytest.approx([expected] * n, abs=1e-5)
        assert batch["advantages"][row, :p].abs().sum() == 0


def test_uneven_rows_dropped_and_unscored_groups_refused(tok):
    groups = [_group(tok, "a", "1+1=", "2", ["2", "3", "2"])]
    with pytest.raises(ValueError, match="score_groups"):
        build_experience(groups, tok, AdvantageConfig())
    _scored(groups, tok)
    batch, m = build_experience(groups, tok, AdvantageConfig(), n_minibatches=2)
    assert m["experience/num_samples_dropped_uneven"] == 1
    assert batch["input_ids"].shape[0] == 2
    batch, m = build_experience([], tok, AdvantageConfig())
    assert batch is None and m["experience/num_samples"] == 0


def test_overlong_penalty_shapes_the_reward_over_the_last_tokens(tok):
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then linear down to -penalty at
    the limit; accuracy counts the reward function's score, training sees the shaped reward."""
    from megatron_bapo.rewards.overlong import overlong_penalty

    assert [overlong_penalty(n, 10, 4) for n in (0, 6, 7, 8, 10, 11)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(9, 10, 4, factor=0.5) == pytest.approx(-0.375) and overlong_penalty(10, 10, 0) == 0.0
    groups = [_group(tok, "a", "12+34=", "64", ["64", "64" + "6" * 20, "1" * 9, "65"])]
    lengths = [s.response_length for s in groups[0].samples]
    cfg = RewardConfig(fn="arithmetic", num_workers=0, overlong_buffer_tokens=8, overlong_penalty=0.5)
    m = _scored(groups, tok, cfg, max_response_tokens=max(lengths))
    expected = [float(t) + overlong_penalty(n, max(lengths), 8, 0.5) for t, n in zip([1, 0, 0, 0], lengths)]
    assert [s.reward for s in groups[0].samples] == pytest.approx(expected)
    assert m["rollout/accuracy"] == 0.25  # the task score, not the shaped reward
    assert m["reward/num_overlong_penalized"] == sum(p < 0 for p in (e - t for e, t in zip(expected, [1, 0, 0, 0])))
    assert m["reward/overlong_penalty_mean"] < 0


def test_reward_timeout_and_failure_rate_fields_act(tok, tmp_path, monkeypatch):
    """reward.timeout_s bounds a plugin call; reward.max_failure_rate decides whether a step whose
    reward function failed stops the run (RewardFailure) or trains on with a warning."""
    import sys
    import time

    from megatron_bapo.experience import RewardFailure

    (tmp_path / "slow_reward_mod.py").write_text(
        "import time\n"
        "def reward(response, answer):\n"
        "    if response == '65':\n"
        "        time.sleep(600)\n"
        "    return float(response == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    groups = [_group(tok, "a", "12+34=", "64", ["64", "65", "64", "1"])]  # 1 of 4 hangs
    fn = "slow_reward_mod:reward"
    started = time.monotonic()
    with pytest.raises(RewardFailure, match=r"failed on 1 of 4 responses \(timeout: 1\).*reward.max_failure_rate=0.2"):
        _scored(groups, tok, RewardConfig(fn=fn, num_workers=0, timeout_s=1.0, max_failure_rate=0.2))
    assert time.monotonic() - started < 60
    m = _scored(groups, tok, RewardConfig(fn=fn, num_workers=0, timeout_s=1.0, max_failure_rate=0.5))
    assert m["reward/num_fn_failures"] == 1.0 and [s.reward for s in groups[0].samples] == [1.0, 0.0, 1.0, 0.0]
