"""The teacher of on-policy distillation (`rollout.teacher`, `rollout.prefill`): a prefill reply is
checked before use; a teacher server that dies is restarted and the scoring retried, or the groups it
could not score are dropped with a count and one log line (never a silent zero); a teacher with
another tokenizer is refused at start naming both paths. Real built-in servers on loopback, killed by
their handle. (Log-probs against a transformers forward on both engines: `teacher_contract.py`.)"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal

import pytest
import torch

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.config import RolloutClientConfig
from megatron_bapo.rollout.errors import ProtocolError
from megatron_bapo.rollout.prefill import parse_prefill_reply, prefill_request
from megatron_bapo.rollout.roles import ServerRoleConfig, close_role_pools, start_role_pools
from megatron_bapo.rollout.teacher import TeacherScorer, check_same_tokenizer
from megatron_bapo.rollout.types import Prompt, RolloutGroup, RolloutRound, Sample, SampleState

IDS = [7, 8, 9, 10, 11]


def reply(entries, **extra):
    return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length", "length": 0},
                                                         "input_token_logprobs": entries, **extra}}


def test_the_prefill_request_starts_one_before_the_response():
    body = prefill_request([7, 8, 9], [10, 11])
    assert body == {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                    "return_logprob": True, "logprob_start_len": 2}


def test_a_prefill_reply_is_checked_before_use():
    good = [[None, 9, None], [-0.5, 10, None], [-1.25, 11, None]]
    assert parse_prefill_reply(reply(good), input_ids=IDS, start=2, url="u") == [-0.5, -1.25]
    # SGLang 0.5.23 reports input ids >= its vocab_size - 1 as 0 (its image-token clip): accepted there only.
    clipped = [[None, 9, None], [-0.5, 10, None], [-1.25, 0, None]]
    assert parse_prefill_reply(reply(clipped), input_ids=IDS, start=2, url="u", vocab_size=12) == [-0.5, -1.25]
    bad = {
        "has 2 entries for logprob_start_len 2 of 5 input tokens (expected 3": reply(good[:2]),
        "input_token_logprobs[2] is for token 12, the request has 11": reply(good[:2] + [[-1.0, 12, None]]),
        "input_token_logprobs[2] is for token 0, the request has 11": reply(clipped),  # no vocab_size: not excused
        "log-prob nan for token 11": reply(good[:2] + [[math.nan, 11, None]]),
        "log-prob -inf for token 11": reply(good[:2] + [[-math.inf, 11, None]]),
        "log-prob 0.5 for token 11": reply(good[:2] + [[0.5, 11, None]]),
        "log-prob None is not a number": reply(good[:2] + [[None, 11, None]]),
        "generated 1 token(s) with max_new_tokens 0": {**reply(good), "output_ids": [3]},
        "finish_reason {'type': 'abort'": {"meta_info": {"finish_reason": {"type": "abort"},
                                                         "input_token_logprobs": good}},
        "has no meta_info": {"text": ""},
    }
    for needle, body in bad.items():
        with pytest.raises(ProtocolError) as err:
            parse_prefill_reply(body, input_ids=IDS, start=2, url="http://t", vocab_size=None)
        assert needle in str(err.value) and "http://t/generate (prefill) reply" in str(err.value), str(err.value)


def _groups(num_groups: int = 3, size: int = 2) -> list[RolloutGroup]:
    groups = []
    for g in range(num_groups):
        samples = [Sample(prompt_ids=[10 + g, 43, 12], response_ids=[30 + i, 61, 5 + g, 7][: 2 + i],
                          response_logprobs=[-1.0] * (2 + i), response_versions=[0] * (2 + i),
                          state=SampleState.COMPLETED, reward=float(i)) for i in range(size)]
        groups.append(RolloutGroup(f"g{g}", Prompt(samples[0].prompt_ids, index=g), samples, 0))
    return groups


def _reference(path, samples) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logp = torch.log_softmax(model(ids).logits[0, len(s.prompt_ids) - 1:-1].double(), -1)
            out.append(logp.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0].tolist())
    return out


def _teacher(tiny_hf_dir, tmp_path, **fields):
    client = RolloutClientConfig(health_timeout_s=120, max_retries=2, backoff_s=0.05)
    return start_role_pools({"teacher": ServerRoleConfig(model_path=str(tiny_hf_dir), client=client, **fields)},
                            seed=0, output_dir=tmp_path, vocab_size=None)


@pytest.mark.slow
def test_a_dead_teacher_server_is_restarted_and_the_scoring_retried(tiny_hf_dir, tmp_path):
    pools = _teacher(tiny_hf_dir, tmp_path)
    try:
        pool = pools["teacher"]
        scorer = TeacherScorer(pool)
        first = _groups(1)
        assert scorer.score(first).num_scored == 2  # a call before the death: nothing to retry
        os.kill(pool.servers[0].pid, signal.SIGKILL)
        pool.servers[0].proc.wait(timeout=30)
        groups = _groups()
        stats = scorer.score(groups)
        samples = [s for g in groups for s in g.samples]
        assert (stats.num_scored, stats.num_failed, pool.restarts) == (6, 0, [1])
        assert pool.servers[0].alive() and pool.client.get_weight_version() == 0
        for got, ref in zip([s.teacher_logprobs for s in samples], _reference(tiny_hf_dir, samples)):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                                       atol=1e-5, rtol=0)
    finally:
        close_role_pools(pools)


def test_groups_a_dead_teacher_could_not_score_are_dropped_and_counted(tiny_hf_dir, tmp_path, caplog):
    from megatron_bapo.config import AdvantageConfig
    from megatron_bapo.experience import build_experience
    from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer

    pools = _teacher(tiny_hf_dir, tmp_path, max_server_restarts=0)
    try:
        pool = pools["teacher"]
        scorer = TeacherScorer(pool)
        groups = _groups()
        assert scorer.score(groups[:1]).num_scored == 2  # scored before the death: kept
        os.kill(pool.servers[0].pid, signal.SIGKILL)
        pool.servers[0].proc.wait(timeout=30)
        stats = scorer.score(groups[1:])  # at rollout time: unscored, left for `complete`
        assert (stats.num_scored, stats.num_failed) == (0, 4) and "(teacher.max_server_restarts)" in stats.errors[0]
        assert all(s.teacher_logprobs is None for g in groups[1:] for s in g.samples)
        with pytest.raises(ValueError, match="no teacher log-probs"):  # never trained as zeros
            build_experience(groups, build_tiny_tokenizer(), AdvantageConfig(), distill=_distill())
        done = RolloutRound(prompts=[g.prompt for g in groups], groups=list(groups))
        with caplog.at_level(logging.WARNING, logger="megatron_bapo.rollout.teacher"):
            metrics = scorer.complete(done)
        assert metrics["distill/num_groups_dropped"] == 2.0
        assert [g.group_id for g in done.groups] == ["g0"] and [g.group_id for g in done.dropped] == ["g1", "g2"]
        [line] = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert line.startswith("teacher: 2 of 3 group(s) dropped from this step") and "died" in line, line
        batch, _ = build_experience(done.groups, build_tiny_tokenizer(), AdvantageConfig(), distill=_distill())
        assert batch["input_ids"].shape[0] == 2
    finally:
        close_role_pools(pools)


def _distill():
    from megatron_bapo.algorithms.distill import DistillConfig

    return DistillConfig(coef=1.0, reward_coef=0.0)


def _other_tokenizer(src, dst, *, swap: bool):
    """A copy of the checkpoint at `src` whose tokenizer has more tokens, or two ids swapped."""
    shutil.copytree(src, dst)
    if not swap:
        from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer

        build_tiny_tokenizer(pad_to_multiple_of=256).save_pretrained(dst)
        return dst
    data = json.loads((dst / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "0", "1"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(data))
    return dst


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tiny_hf_dir, tmp_path):
    check_same_tokenizer(str(tiny_hf_dir), str(tiny_hf_dir))
    for swap, what in ((False, "tokens against the student's"), (True, "mapped to other ids")):
        other = _other_tokenizer(tiny_hf_dir, tmp_path / f"teacher_{swap}", swap=swap)
        with pytest.raises(ConfigError) as err:
            check_same_tokenizer(str(tiny_hf_dir), str(other))
        message = str(err.value)
        assert f"teacher.model_path='{other}'" in message and f"model.hf_path='{tiny_hf_dir}'" in message, message
        assert what in message, message
