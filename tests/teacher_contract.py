"""The teacher's side of the server contract, on both engines: collected by `test_server_contract.py`
(imported at its end, so they run last and on its live server of each engine: the built-in one and
SGLang 0.5.23 on CPU), a pool of the one `ServerPool` standing in for the teacher's (a role changes
what a pool may be sent, not how it talks: `rollout.roles`).

- A teacher prefill (`rollout.prefill`) answers per response token the log-prob of a transformers
  fp32 forward of the served weights (per token KL < 1e-6), with the first `input_token_logprobs`
  entry null, as SGLang's own code says; cached prompt prefixes do not shorten it.
- A teacher server SIGKILLed while it holds the scoring's requests is restarted by its pool and the
  scoring retried: every response scored, as the restarted server computes it.
- A judge's generation (`rewards.judge`: the filled template through the judge's tokenizer, a greedy
  `/generate`, the decoded text parsed) is accepted and parsed on both engines, the same verdict for
  the same input.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from contract_helpers import PROMPT
from megatron_bapo.rollout.prefill import prefill_request
from megatron_bapo.rollout.teacher import TeacherScorer
from megatron_bapo.rollout.types import Prompt, RolloutGroup, Sample, SampleState

MAX_KL = 1e-6


def _groups(tag: int) -> list[RolloutGroup]:
    """Responses of 1 to 120 tokens to two prompts (each prompt scored several times: the second
    prefill finds its prefix cached)."""
    out = []
    for g, prompt in enumerate((PROMPT, PROMPT[:3] + [tag + 1])):
        samples = []
        for n in (1, 7, 120):
            response = [(37 * (i + 1) + 11 * g + n + tag) % 200 + 3 for i in range(n)]
            samples.append(Sample(prompt_ids=list(prompt), response_ids=response, response_logprobs=[-1.0] * n,
                                  response_versions=[0] * n, state=SampleState.COMPLETED))
        out.append(RolloutGroup(f"t{tag}-{g}", Prompt(list(prompt)), samples, 0))
    return out


def _check_against_a_forward(served, groups) -> None:
    """Every sample's teacher log-probs equal the served weights' transformers fp32 log-probs: per token
    k3 KL exp(d) - 1 - d < MAX_KL, d = reference - served."""
    for s in (s for g in groups for s in g.samples):
        ref = served.ref_logprobs(s.prompt_ids, s.response_ids)
        d = ref - torch.tensor(s.teacher_logprobs, dtype=torch.float64)
        kl = d.exp() - 1.0 - d
        assert len(s.teacher_logprobs) == len(s.response_ids) and float(kl.max()) < MAX_KL, (kl.max(), d.abs().max())


def test_teacher_prefill_log_probs_equal_a_transformers_forward(served):
    response = [30, 61, 5, 7, 9]
    status, text = served.http("POST", "/generate", {**prefill_request(PROMPT, response), "rid": uuid.uuid4().hex})
    assert status == 200, text
    body = json.loads(text)
    entries = body["meta_info"]["input_token_logprobs"]
    assert body["output_ids"] == [] and body["meta_info"]["finish_reason"]["type"] == "length"
    assert [e[1] for e in entries] == [PROMPT[-1]] + response  # from logprob_start_len = len(prompt) - 1 on
    assert entries[0][0] is None and all(isinstance(e[0], float) for e in entries[1:])  # SGLang: first null
    groups = _groups(0)
    stats = TeacherScorer(served.pool).score(groups)
    assert (stats.num_scored, stats.num_failed) == (6, 0)
    _check_against_a_forward(served, groups)


def test_a_teacher_server_killed_mid_scoring_is_restarted_and_the_scoring_retried(served):
    pool, scorer = served.pool, TeacherScorer(served.pool)
    scorer.score(_groups(1))  # the client's concurrency is fitted (it asks the server) before the server stops
    budget = pool.rollout.max_server_restarts
    restarts = pool.restarts[0]
    pool.rollout.max_server_restarts = restarts + 1  # this restart, whatever the module's tests used
    server = pool.servers[0]
    groups = _groups(2)
    sent = pool.client.stats["num_requests"]
    os.kill(server.pid, signal.SIGSTOP)  # it accepts connections and answers none: the requests stay in flight
    try:
        with ThreadPoolExecutor(1) as ex:
            scoring = ex.submit(scorer.score, groups)
            deadline = time.monotonic() + 60
            while pool.client.stats["num_requests"] < sent + 6:
                assert time.monotonic() < deadline and not scoring.done(), "the scoring never reached the server"
                time.sleep(0.01)
            server.proc.kill()  # by its handle, mid-scoring
            stats = scoring.result(timeout=600)
    finally:
        pool.rollout.max_server_restarts = budget
    assert (stats.num_scored, stats.num_failed) == (6, 0) and pool.restarts[0] == restarts + 1
    assert pool.servers[0].pid != server.pid and pool.servers[0].alive()
    _check_against_a_forward(served, groups)


def verdict_length(text: str) -> float:
    """A judge parse rule (`reward.judge.parse_fn`) that reads any generation: its length in characters."""
    return float(len(text))


def test_a_judge_generation_is_accepted_and_parsed(served):
    from transformers import AutoTokenizer

    from megatron_bapo.rewards.judge import JudgeReward
    from megatron_bapo.rewards.judge_config import JudgeConfig

    from contract_helpers import API_KEY

    config = JudgeConfig(urls=[served.url], api_key=API_KEY, template="Q: {prompt}\nA: {response}\nRef: {answer}\nCorrect? yes/no",
                         parse_fn="teacher_contract:verdict_length", max_new_tokens=6, temperature=0.0, timeout_s=60)
    judge = JudgeReward.for_urls(config, [served.url], AutoTokenizer.from_pretrained(served.model_a))
    try:
        results = judge.score(["1+2="] * 3 + ["4+4="], ["3", "3", "3", "8"], ["3", "3", "3", "8"])
    finally:
        judge.close()
    assert [r.reason for r in results] == ["scored"] * 4, [(r.reason, r.error) for r in results]
    assert all(0 < r.reward <= 6 * 16 for r in results), results  # 1-6 tokens of text
    assert results[0].reward == results[1].reward == results[2].reward  # greedy: one input, one verdict
