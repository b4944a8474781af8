"""`rollout.max_failed_group_rate` counts the failed groups against every group that ended in the step.

A step's round comes from the real rollout path: a `DynamicSampler` under `filter` over a
`PartialRolloutManager` and `RolloutClient`, against the stand-in server (`tests/fake_server.py`, real
loopback HTTP), which here rejects (400, as SGLang does a bad request) the requests of some prompts.
The driver's check then reads that round. Groups that dynamic sampling drops (zero variance) finished:
they belong in the denominator as much as the trained ones, or an early filter run, which drops most
groups, is stopped for a failure rate it does not have.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from fake_server import FakeServer, ThreadedFakeServer, _error
from megatron_bapo.config import ModelConfig, RolloutConfig, RunConfig
from megatron_bapo.data.config import DatasetConfig
from megatron_bapo.driver import Driver
from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient,
                                   RolloutClientConfig, RolloutError)
from megatron_bapo.rollout.dynamic_sampling import DynamicSampler, manager_round, requeue_into

REJECTED = 63
"""Prompts starting with this token are rejected by the server."""
G = 4


@pytest.fixture
def rejecting_server(monkeypatch):
    """The stand-in server, rejecting every request whose prompt starts with `REJECTED`."""
    generate = FakeServer.generate

    async def generate_or_reject(self: FakeServer, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("input_ids", [None])[0] == REJECTED:
            return _error(400, "Requested token count exceeds the model's maximum context length")
        return await generate(self, request)

    monkeypatch.setattr(FakeServer, "generate", generate_or_reject)
    with ThreadedFakeServer() as server:
        yield server.url


def _step(url: str, *, num_prompts: int, rejected: set[int], trained: set[int]):
    """One `filter` step over `num_prompts` prompts: those in `rejected` fail at the server; of the
    others, those in `trained` score with variance (kept), the rest all 1.0 (dropped as zero variance)."""
    prompts = [Prompt(prompt_ids=[REJECTED if i in rejected else 2 + i, 5, 6], answer="", index=i)
               for i in range(num_prompts)]

    def score(groups):
        for g in groups:
            for j, s in enumerate(g.samples):
                s.reward = float(j % 2) if g.prompt.index in trained else 1.0

    with RolloutClient(RolloutClientConfig(urls=[url], backoff_s=0.05, backoff_max_s=0.2)) as client:
        manager = PartialRolloutManager(client, PartialRolloutConfig(group_size=G, max_response_tokens=4))
        sampler = DynamicSampler(mode="filter", prompts_per_step=num_prompts, max_refill_rounds=1,
                                 draw=lambda n: prompts[:n], advance=manager_round(manager),
                                 requeue=requeue_into(manager), score=score)
        return client.run(sampler.produce(0))


def _driver(tmp_path, **rollout) -> Driver:
    config = RunConfig(model=ModelConfig(hf_path=str(tmp_path)), data=DatasetConfig(path=str(tmp_path / "d.jsonl")),
                       rollout=RolloutConfig(**rollout))
    return Driver(config, tmp_path)


def test_groups_dropped_by_the_filter_count_in_the_failed_group_rate(rejecting_server, tmp_path):
    """16 groups: 2 rejected, 13 zero-variance (dropped), 1 trained. 2 of 16 failed (12.5%), under the
    default 0.5: the step trains on (2 of the 3 trained-or-failed read 67% and stopped the run)."""
    done = _step(rejecting_server, num_prompts=16, rejected={0, 1}, trained={2})
    assert (len(done.groups), len(done.dropped), done.metrics["rollout/num_groups_failed"]) == (1, 13, 2.0)
    assert len(done.rejections) == 2 * G
    _driver(tmp_path)._check_rejections(done)


def test_a_step_whose_groups_mostly_fail_still_stops_naming_the_field(rejecting_server, tmp_path):
    """10 of 16 groups rejected (62.5%), 5 of the 6 that finished dropped: over the limit, the run stops
    with the server's message, the counts and the field; a limit of 1 trains on."""
    done = _step(rejecting_server, num_prompts=16, rejected=set(range(10)), trained={10})
    assert (len(done.groups), len(done.dropped), done.metrics["rollout/num_groups_failed"]) == (1, 5, 10.0)
    with pytest.raises(RolloutError) as err:
        _driver(tmp_path)._check_rejections(done)
    msg = str(err.value)
    assert msg.startswith("the servers rejected (4xx) the requests of 10 of 16 groups"), msg
    assert "rollout.max_failed_group_rate=0.5" in msg and "maximum context length" in msg and "\n" not in msg
    _driver(tmp_path, max_failed_group_rate=1.0)._check_rejections(done)
