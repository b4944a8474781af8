"""Rollout groups -> actor batch: rewards, GRPO advantages, token alignment, filtering."""

import pytest
import torch
from transformers import AutoTokenizer

from megatron_bapo.config import AdvantageConfig, RewardConfig
from megatron_bapo.experience import build_experience
from megatron_bapo.rollout.types import Prompt, RolloutGroup, Sample, SampleState


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
    batch, m = build_experience(groups, tok, RewardConfig(fn="arithmetic", num_workers=0), AdvantageConfig())
    rewards = torch.tensor([s.reward for g in groups for s in g.samples])
    assert rewards.tolist() == [1, 0, 1, 0, 1, 1, 1, 1]
    assert m["rollout/accuracy"] == pytest.approx(6 / 8)
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


def test_uniform_groups_filtered_and_uneven_rows_dropped(tok):
    groups = [_group(tok, "a", "1+1=", "2", ["2", "3", "2"]), _group(tok, "b", "2+2=", "4", ["4", "4", "4"])]
    adv = AdvantageConfig(filter_uniform_groups=True)
    batch, m = build_experience(groups, tok, RewardConfig(fn="arithmetic", num_workers=0), adv, n_minibatches=2)
    assert m["experience/num_groups_filtered"] == 1
    assert m["experience/num_samples_dropped_uneven"] == 1
    assert batch["input_ids"].shape[0] == 2
    all_uniform = [_group(tok, "b", "2+2=", "4", ["4", "4"])]
    batch, m = build_experience(all_uniform, tok, RewardConfig(fn="arithmetic", num_workers=0), adv)
    assert batch is None and m["experience/num_samples"] == 0


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
        build_experience(groups, tok, RewardConfig(fn=fn, num_workers=0, timeout_s=1.0, max_failure_rate=0.2),
                         AdvantageConfig())
    assert time.monotonic() - started < 60
    batch, m = build_experience(groups, tok, RewardConfig(fn=fn, num_workers=0, timeout_s=1.0, max_failure_rate=0.5),
                                AdvantageConfig())
    assert m["reward/num_fn_failures"] == 1.0 and [s.reward for s in groups[0].samples] == [1.0, 0.0, 1.0, 0.0]
