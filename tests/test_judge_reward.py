"""The judge reward (`reward.fn: judge`, `rewards.judge`): a judge served over real loopback HTTP
reads each response, and its generation, parsed, is the reward.

The judge here is the fake server scripted to write a verdict chosen by the test from what the
judge's prompt says (a tiny model's verdicts are arbitrary; the slow end-to-end run in
`test_judge_e2e.py` uses the built-in server and the tiny model). Checked: the prompt the judge gets,
the verdict parsed by a regex (last match, `values` or a number) and by a callable, every missing
verdict counted by reason (unparseable, error, a server that never answers), its group dropped
(`on_failure: drop_group`) or its 0 trained (`score_zero`) in training and in avg@k evaluation, the
reward's failure limit, and config errors naming the field. `test_every_field_has_a_test` ties each
`reward.judge` field to the test that shows it acting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import re
import socket

import pytest

from agent_helpers import EOS_ID, tokenizer
from fake_server import ThreadedFakeServer
from megatron_bapo.config import RewardConfig, RunConfig
from megatron_bapo.config_io import ConfigError, from_dict
from megatron_bapo.eval import EvalConfig, EvalDatasetConfig, Sample as EvalSample, run_evaluation
from megatron_bapo.experience import RewardFailure, score_groups
from megatron_bapo.rewards import RewardSpecError
from megatron_bapo.rewards.judge import JudgeReward, start_judge
from megatron_bapo.rewards.judge_config import JudgeConfig
from megatron_bapo.rollout.dynamic_sampling import DynamicSampler
from megatron_bapo.rollout.types import Prompt, RolloutGroup, RolloutRound, Sample, SampleState

TOK = tokenizer()
TEMPLATE = "P: {prompt}\nR: {response}\nA: {answer}\nVERDICT:"
YES_NO = {"parse_regex": r"(?i)\b(yes|no)\b", "values": {"yes": 1, "no": 0}}
VERDICTS = {"right": "thinking... no wait, YES", "wrong": "no", "maybe": "I cannot tell", "{answer}": "yes"}
"""What the scripted judge writes for each response ("right": the last match decides)."""
_FIELDS = re.compile(r"P: (.*?)\nR: (.*?)\nA: (.*?)\nVERDICT:", re.S)


def judge_policy(verdict):
    """The fake server's `policy`: the judge's prompt ends at the chat template's assistant turn (or at
    "VERDICT:" without one); it then writes `verdict(prompt, response, answer)` and EOS."""
    markers = [TOK.encode("<|im_start|>assistant\n"), TOK.encode("VERDICT:")]
    cache: dict[tuple, list[int]] = {}

    def policy(prefix: list[int], seed: int) -> int:
        end = next(e for m in markers if (e := _end_of_last(prefix, m)) is not None)
        key = tuple(prefix[:end])
        if key not in cache:
            p, r, a = _FIELDS.search(TOK.decode(prefix[:end], skip_special_tokens=True)).groups()
            cache[key] = TOK.encode(verdict(p, r, a)) + [EOS_ID]
        k = len(prefix) - end
        return cache[key][k] if k < len(cache[key]) else EOS_ID

    return policy


def _end_of_last(ids: list[int], sub: list[int]):
    for i in range(len(ids) - len(sub), -1, -1):
        if ids[i:i + len(sub)] == sub:
            return i + len(sub)
    return None


def by_response(p, r, a):
    return VERDICTS.get(r, "yes")


@contextlib.contextmanager
def judge(verdict=by_response, server_kw=None, **cfg):
    """(JudgeReward over a scripted judge server, the fake server)."""
    with ThreadedFakeServer(policy=judge_policy(verdict), **(server_kw or {})) as srv:
        reward = JudgeReward.for_urls(JudgeConfig(**{"template": TEMPLATE, **YES_NO, "timeout_s": 60.0, **cfg}),
                                      [srv.url], TOK)
        try:
            yield reward, srv.server
        finally:
            reward.close()


@contextlib.contextmanager
def silent_server():
    """A server that never answers: the kernel accepts connections into the backlog, nothing reads them."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def reasons(results):
    return [r.reason for r in results]


def test_the_judge_reads_the_filled_template_and_the_last_yes_or_no_decides():
    with judge(max_new_tokens=40, temperature=0.3) as (j, server):
        responses = ["right", "wrong", "maybe", "{answer}"]
        results = j.score(["Q1"] * 4, responses, ["42"] * 4)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert reasons(results) == ["scored", "scored", "judge_unparseable", "scored"]
    assert results[2].failed and "no match of reward.judge.parse_regex" in results[2].error
    # One user message through the judge tokenizer's chat template; placeholders filled literally, once.
    sent = sorted(TOK.decode(ids) for ids in server.requests)
    expected = sorted(TOK.apply_chat_template([{"role": "user", "content": TEMPLATE.replace("{prompt}", "Q1").replace(
        "{answer}", "42").replace("{response}", r)}], tokenize=False, add_generation_prompt=True) for r in responses)
    assert sent == expected
    assert sum("R: {answer}\nA: 42\n" in text for text in sent) == 1
    assert all(p == {"max_new_tokens": 40, "temperature": 0.3} for p in server.params)


def test_a_number_verdict_and_a_callable_parse_rule(tmp_path, monkeypatch):
    scores = {"a": "SCORE=0.25", "b": "SCORE=7", "c": "SCORE=high", "d": "SCORE=nan"}
    with judge(lambda p, r, a: scores[r], parse_regex=r"SCORE=(\S+)", values={}) as (j, _):
        results = j.score(["q"] * 4, list(scores), ["x"] * 4)
    assert [r.reward for r in results] == [0.25, 7.0, 0.0, 0.0]
    assert reasons(results) == ["scored", "scored", "judge_unparseable", "judge_unparseable"]

    (tmp_path / "judge_parse_mod.py").write_text(
        "def parse(text):\n"
        "    if 'boom' in text:\n        raise RuntimeError('bad judge format')\n"
        "    return float(text.split('score ')[1]) if 'score ' in text else None\n"
        "def wordy(text):\n    return 'high'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    said = {"a": "my score 0.5", "b": "no idea", "c": "boom"}
    with judge(lambda p, r, a: said[r], parse_regex="", values={}, parse_fn="judge_parse_mod:parse") as (j, _):
        results = j.score(["q"] * 3, list(said), ["x"] * 3)
    assert [r.reward for r in results] == [0.5, 0.0, 0.0]
    assert reasons(results) == ["scored", "judge_unparseable", "judge_error"]
    assert "RuntimeError: bad judge format" in results[2].error
    with judge(parse_regex="", values={}, parse_fn="judge_parse_mod:wordy") as (j, _):
        [result] = j.score(["q"], ["a"], ["x"])
    assert result.reason == "judge_error" and "returned 'high'" in result.error


def _group(gid, responses, answer="42"):
    prompt = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": "What is 6*7?"}], tokenize=False,
                                                add_generation_prompt=True))
    samples = [Sample(prompt_ids=prompt, response_ids=TOK.encode(r) + [EOS_ID], response_logprobs=[-0.5] * (len(r) + 1),
                      response_versions=[0] * (len(r) + 1), state=SampleState.COMPLETED, num_segments=1)
               for r in responses]
    return RolloutGroup(group_id=gid, prompt=Prompt(prompt_ids=prompt, answer=answer, index=int(gid[1:])),
                        samples=samples, start_version=0)


def _round(groups, j, mode="filter", max_failure_rate=0.5):
    """One `DynamicSampler` step over `groups`, scored by `experience.score_groups` with the judge."""
    cfg = RewardConfig(fn="judge", num_workers=0, max_failure_rate=max_failure_rate)

    async def advance(prompts, version, only_aborted=False):
        return RolloutRound(prompts=[g.prompt for g in groups], groups=groups)

    sampler = DynamicSampler(mode=mode, prompts_per_step=len(groups), max_refill_rounds=1, draw=lambda n: [],
                             advance=advance, requeue=lambda gs: None,
                             score=functools.partial(score_groups, tokenizer=TOK, reward_cfg=cfg,
                                                     max_response_tokens=64, judge=j))
    return asyncio.run(sampler.produce(0))


@pytest.mark.parametrize("on_failure", ["drop_group", "score_zero"])
def test_an_unparseable_verdict_is_counted_and_its_group_dropped_or_scored_zero(on_failure):
    groups = [_group("g1", ["right", "right", "wrong", "wrong"]), _group("g2", ["right", "maybe", "wrong", "right"])]
    prompts_seen = []
    with judge(lambda p, r, a: prompts_seen.append(p) or by_response(p, r, a), on_failure=on_failure) as (j, _):
        done = _round(groups, j)
    m = done.metrics
    assert [m[f"judge/num_{k}"] for k in ("scored", "unparseable", "timeout", "error")] == [7, 1, 0, 0]
    assert m["reward/num_fn_failures"] == 1 and m["experience/num_groups_filtered"] == 0
    assert set(prompts_seen) == {"user\nWhat is 6*7?\nassistant\n"}  # the policy's prompt, special tokens removed
    assert [s.reward for s in groups[1].samples] == [1.0, 0.0, 0.0, 1.0]
    if on_failure == "drop_group":
        assert [g.group_id for g in done.groups] == ["g1"] and [g.group_id for g in done.dropped] == ["g2"]
        assert m["judge/num_groups_dropped"] == 1 and m["rollout/reward_mean"] == 0.5  # g1's rewards only
    else:
        assert [g.group_id for g in done.groups] == ["g1", "g2"] and not done.dropped
        assert m["judge/num_groups_dropped"] == 0 and m["rollout/reward_mean"] == 0.5  # (2 + 2) / 8


def test_a_judge_that_never_answers_times_out_counted_and_stops_the_run_past_the_failure_limit():
    with silent_server() as url:
        cfg = JudgeConfig(template=TEMPLATE, **YES_NO, timeout_s=0.5)
        j = JudgeReward.for_urls(cfg, [url], TOK)
        try:
            groups = [_group("g1", ["right", "wrong"]), _group("g2", ["right", "right"])]
            with pytest.raises(RewardFailure, match=r"failed on 4 of 4 responses \(judge_timeout: 4\).*"
                                                    r"reward.judge.timeout_s.*reward.max_failure_rate=0.5"):
                _round(groups, j)
            groups = [_group("g3", ["right", "wrong"]), _group("g4", ["right", "right"])]
            done = _round(groups, j, mode="off", max_failure_rate=1.0)
        finally:
            j.close()
    assert done.metrics["judge/num_timeout"] == 4 and done.metrics["judge/num_groups_dropped"] == 2
    assert not done.groups and len(done.dropped) == 2 and "rollout/reward_mean" not in done.metrics


class ScriptedPolicy:
    """The policy under evaluation: response k of a problem is `RESPONSES[problem][k]` (no HTTP:
    what is tested is the judge's grading, which goes over HTTP)."""

    RESPONSES = {"p1": ["right", "right"], "p2": ["right", "wrong"], "p3": ["maybe", "right"]}

    def __init__(self):
        self.calls: dict[str, int] = {}

    async def generate(self, input_ids, sampling_params):
        problem = TOK.decode(input_ids)
        k = self.calls[problem] = self.calls.get(problem, -1) + 1
        return EvalSample(text=self.RESPONSES[problem][k], num_tokens=1)


@pytest.mark.parametrize("on_failure, avg", [("drop_group", (1 + 0.5) / 2), ("score_zero", (1 + 0.5 + 0.5) / 3)])
def test_avg_at_k_evaluation_graded_by_the_judge(tmp_path, on_failure, avg):
    data = tmp_path / "judged.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n" for p in ScriptedPolicy.RESPONSES))
    cfg = EvalConfig(every_n_steps=1, datasets=[EvalDatasetConfig("j", str(data))], n=2, reward="judge")
    with judge(on_failure=on_failure) as (j, _):
        metrics = asyncio.run(run_evaluation(ScriptedPolicy(), TOK, cfg, output_dir=tmp_path, judge=j))
    assert metrics["eval/j/avg@2"] == pytest.approx(avg)
    assert (metrics["eval/j/judge_num_scored"], metrics["eval/j/judge_num_unparseable"]) == (5, 1)
    assert metrics["eval/j/judge_num_problems_dropped"] == (on_failure == "drop_group")
    records = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert [r.get("judge_dropped", False) for r in records] == [False, False, on_failure == "drop_group"]
    assert records[2]["responses"][0]["reason"] == "judge_unparseable"
    with pytest.raises(ValueError, match="eval.reward=judge grades with the run's judge servers"):
        asyncio.run(run_evaluation(ScriptedPolicy(), TOK, cfg))


def test_the_evaluation_tool_grades_with_a_run_configs_judge(tiny_hf_dir, tmp_path, capsys):
    import yaml

    from megatron_bapo.eval.cli import main

    data = tmp_path / "tool.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n" for p in ("1+1=", "2+2=", "3+3=")))
    args = ["--model-path", str(tiny_hf_dir), "--data", str(data), "--n", "2", "--max-new-tokens", "3",
            "--output", str(tmp_path / "out")]
    with ThreadedFakeServer() as policy, ThreadedFakeServer(policy=judge_policy(lambda p, r, a: "no")) as judge_srv:
        run_cfg = tmp_path / "run.yaml"
        run_cfg.write_text(yaml.safe_dump({"reward": {"judge": {"urls": [judge_srv.url], **COMPLETE}}}))
        assert main([*args, "--server-url", policy.url, "--judge-config", str(run_cfg)]) == 0
        assert judge_srv.server.num_generate == 6
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]
    assert metrics["eval/tool/avg@2"] == 0.0 and metrics["eval/tool/judge_num_scored"] == 6
    assert main([*args, "--reward", "judge"]) == 2
    assert "--judge-config RUN.yaml" in capsys.readouterr().err


def _run_config(reward=None, eval_=None):
    return from_dict(RunConfig, {"model": {"hf_path": "m"}, "data": {"path": "d.jsonl"}, "reward": reward or {},
                                 "eval": eval_ or {}})


COMPLETE = {"template": TEMPLATE, **YES_NO}
EVAL_ON = {"reward": "judge", "every_n_steps": 5, "datasets": [{"name": "t", "path": "t.jsonl"}]}


@pytest.mark.parametrize("reward, eval_, needle", [
    ({"fn": "judge"}, None, "reward.fn=judge needs reward.judge.template"),
    ({"fn": "judge", "judge": {"template": TEMPLATE}}, None, "reward.fn=judge needs a parse rule: reward.judge.parse_"),
    ({"judge": {"parse_regex": "(a)(b)"}}, None, "reward.judge.parse_regex='(a)(b)' has 2 groups; it needs exactly"),
    ({"judge": {"parse_regex": "(a"}}, None, "reward.judge.parse_regex='(a' is not a regular expression"),
    ({"judge": {"parse_regex": "(a)", "parse_fn": "m:f"}}, None, "parse_regex and reward.judge.parse_fn are both set"),
    ({"judge": {"values": {"yes": 1}}}, None, "reward.judge.values maps the text parse_regex captures"),
    ({"judge": {**COMPLETE, "values": {"yes": "high"}}}, None, "reward.judge.values['yes']='high': each value must be"),
    ({"judge": {"template": "{question}: {response}"}}, None, "reward.judge.template names {question}"),
    ({"judge": {"template": "{prompt}"}}, None, "reward.judge.template has no {response}"),
    ({"judge": {"on_failure": "skip"}}, None, "reward.judge.on_failure must be one of ('drop_group', 'score_zero')"),
    ({"judge": {"timeout_s": 0}}, None, "reward.judge.timeout_s must be > 0"),
    ({"judge": {"max_new_tokens": 0}}, None, "reward.judge.max_new_tokens must be >= 1"),
    ({"judge": {"max_concurrency": 0}}, None, "reward.judge.max_concurrency must be >= 1"),
    ({"judge": {"temperature": -1}}, None, "reward.judge.temperature must be >= 0"),
    ({"judge": {"parse_fn": "nocolon"}}, None, "reward.judge.parse_fn='nocolon': expected an import path"),
    ({"judge": {"urls": ["judge:8000"]}}, None, "reward.judge.urls: 'judge:8000' must start with http://"),
    ({"judge": {"template": TEMPLATE}}, EVAL_ON,
     "eval.reward=judge needs a parse rule"),
])
def test_config_errors_name_the_field_and_the_fix(reward, eval_, needle):
    with pytest.raises(ConfigError) as err:
        _run_config(reward, eval_)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_run_starts_its_judge_only_where_selected_and_refuses_a_judge_it_cannot_reach(tiny_hf_dir, tmp_path):
    ok = _run_config({"fn": "judge", "judge": COMPLETE})
    off = _run_config({"judge": COMPLETE}, {"reward": "judge"})  # eval.reward=judge, evaluation off
    assert start_judge(off.reward, off.eval, urls=["http://127.0.0.1:1"], model_path=str(tiny_hf_dir)) is None
    with pytest.raises(ConfigError, match=r"^reward.judge.urls is empty: list the judge servers"):
        start_judge(ok.reward, ok.eval, urls=[], model_path=str(tiny_hf_dir))
    with pytest.raises(ConfigError, match=r"^reward.judge.tokenizer: cannot load a tokenizer from"):
        start_judge(ok.reward, ok.eval, urls=["http://127.0.0.1:1"], model_path=str(tmp_path / "nothing"))
    bad = _run_config({"fn": "judge", "judge": {"template": TEMPLATE, "parse_fn": "no_such_judge_mod:parse"}})
    with pytest.raises(RewardSpecError, match=r"reward.judge.parse_fn spec 'no_such_judge_mod:parse': cannot import"):
        start_judge(bad.reward, bad.eval, urls=["http://127.0.0.1:1"], model_path=str(tiny_hf_dir))


def test_the_judges_own_tokenizer_and_url_list_and_its_concurrency(tiny_hf_dir, tmp_path):
    plain = tmp_path / "plain_tok"  # the judge's tokenizer: no chat template, so the template goes as it is
    tok = tokenizer()
    tok.chat_template = None
    tok.save_pretrained(plain)
    with ThreadedFakeServer(policy=judge_policy(by_response), token_delay_s=0.01) as srv:
        cfg = _run_config({"fn": "judge", "judge": {**COMPLETE, "urls": [srv.url], "tokenizer": str(plain),
                                                    "max_concurrency": 2}})
        j = start_judge(cfg.reward, cfg.eval, urls=cfg.reward.judge.urls, model_path=str(tiny_hf_dir))
        try:
            results = j.score(["q"] * 6, ["right", "wrong"] * 3, ["1"] * 6)
        finally:
            j.close()
        assert [r.reward for r in results] == [1.0, 0.0] * 3
        assert all(TOK.decode(ids).startswith("P: q\nR: ") for ids in srv.server.requests)  # no chat template
        assert srv.server.num_generate == 6 and srv.server.max_running <= 2


def test_the_judges_api_key_is_sent(tiny_hf_dir, tmp_path):
    """Judge servers started with an API key (SGLang's --api-key; here the built-in server's) answer
    401 without it: every verdict an error, counted; with `api_key` (or a judge pool's own key) they grade."""
    from transformers import AutoTokenizer

    from megatron_bapo.server.launch import start_server

    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    with start_server(tiny_hf_dir, extra_args=["--api-key", "judge-key"], log_path=tmp_path / "judge.log") as srv:
        reasons = {}
        for how, cfg_key, pool_key in (("none", None, None), ("field", "judge-key", None), ("pool", None, "judge-key")):
            cfg = JudgeConfig(template=TEMPLATE, parse_fn="teacher_contract:verdict_length", api_key=cfg_key,
                              max_new_tokens=2, temperature=0.0, timeout_s=30.0)
            j = JudgeReward.for_urls(cfg, [srv.url], tok, api_key=pool_key)
            try:
                reasons[how] = [(r.reason, r.error) for r in j.score(["1+1="], ["2"], ["2"])]
            finally:
                j.close()
    assert reasons["none"][0][0] == "judge_error" and "401" in reasons["none"][0][1], reasons
    assert reasons["field"] == reasons["pool"] == [("scored", None)], reasons


FIELD_TESTS = {
    "api_key": "test_the_judges_api_key_is_sent",
    "urls": "test_the_evaluation_tool_grades_with_a_run_configs_judge",
    "tokenizer": "test_the_judges_own_tokenizer_and_url_list_and_its_concurrency",
    "max_concurrency": "test_the_judges_own_tokenizer_and_url_list_and_its_concurrency",
    "template": "test_the_judge_reads_the_filled_template_and_the_last_yes_or_no_decides",
    "parse_regex": "test_a_number_verdict_and_a_callable_parse_rule",
    "values": "test_the_judge_reads_the_filled_template_and_the_last_yes_or_no_decides",
    "parse_fn": "test_a_number_verdict_and_a_callable_parse_rule",
    "max_new_tokens": "test_the_judge_reads_the_filled_template_and_the_last_yes_or_no_decides",
    "temperature": "test_the_judge_reads_the_filled_template_and_the_last_yes_or_no_decides",
    "timeout_s": "test_a_judge_that_never_answers_times_out_counted_and_stops_the_run_past_the_failure_limit",
    "on_failure": "test_an_unparseable_verdict_is_counted_and_its_group_dropped_or_scored_zero",
}
"""Each `reward.judge` field -> the test above that shows it acting (a non-default value, its effect)."""


def test_every_field_has_a_test():
    fields = {f.name for f in dataclasses.fields(JudgeConfig)}
    assert set(FIELD_TESTS) == fields, f"fields without a test: {sorted(fields - set(FIELD_TESTS))}"
    assert all(callable(globals().get(name)) for name in FIELD_TESTS.values())
