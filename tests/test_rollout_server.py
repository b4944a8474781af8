"""The rollout client against the built-in CPU server (real processes, loopback HTTP, tiny random
Qwen2 checkpoints): versions and behavior log-probs across weight updates, token-identical
resumption, and a server killed mid-rollout."""

from __future__ import annotations

import contextlib

import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient,
                                   RolloutClientConfig, SampleState, SamplingConfig, flatten)
from megatron_bapo.server.launch import start_server
from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

SERVER_ARGS = ["--num-threads", "1", "--context-length", "512", "--log-level", "warning", "--enable-deterministic-inference"]


@pytest.fixture(scope="module")
def checkpoints(tiny_hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_ckpts")
    return [str(tiny_hf_dir)] + [str(make_tiny_hf_checkpoint(root / f"seed{s}", seed=s)) for s in (1, 2)]


@contextlib.contextmanager
def _server_pair(checkpoint: str):
    """Two built-in servers started in parallel, stopped on exit."""
    with ThreadPoolExecutor(2) as pool:
        handles = list(pool.map(lambda _: start_server(checkpoint, extra_args=SERVER_ARGS), range(2)))
    try:
        yield handles
    finally:
        for h in handles:
            h.stop()


@pytest.fixture(scope="module")
def servers(checkpoints):
    with _server_pair(checkpoints[0]) as handles:
        yield handles


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoints[0])


def make_prompts(tokenizer, n):
    return [Prompt(prompt_ids=tokenizer(f"{i}+{i + 3}=", add_special_tokens=False)["input_ids"], answer="", index=i)
            for i in range(n)]


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from one plain transformers forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.slow
def test_partial_rollout_across_weight_updates_versions_and_logprobs(servers, checkpoints, tokenizer):
    from transformers import AutoModelForCausalLM

    urls = [h.url for h in servers]
    cfg = PartialRolloutConfig(group_size=2, max_response_tokens=14, segment_tokens=4, max_staleness=None,
                               sampling=SamplingConfig(temperature=1.0))
    path_of = {}
    with RolloutClient(RolloutClientConfig(urls=urls)) as client:
        client.wait_healthy(timeout_s=120)
        manager = PartialRolloutManager(client, cfg)
        todo, finished = make_prompts(tokenizer, 4), []
        for version in range(1, 10):
            path_of[version] = checkpoints[version % 3]
            client.update_weights_from_disk(path_of[version], version)
            assert client.get_weight_version() == version
            finished += manager.step(todo[:2], version).groups
            todo = todo[2:]
            if not todo and not manager.buffer:
                break
        client.flush_cache()
        client.pause_generation()
        client.continue_generation()
    assert not manager.buffer and sorted(g.prompt.index for g in finished) == [0, 1, 2, 3]
    models = {p: AutoModelForCausalLM.from_pretrained(p).eval() for p in checkpoints}
    num_checked, mixed = 0, 0
    for s in flatten(finished):
        assert s.state in (SampleState.COMPLETED, SampleState.TRUNCATED)
        assert s.response_versions == sorted(s.response_versions)
        mixed += len(set(s.response_versions)) > 1
        ids = s.prompt_ids + s.response_ids
        p = len(s.prompt_ids)
        for version in set(s.response_versions):
            ref = reference_logprobs(models[path_of[version]], ids)[p - 1:]
            for i, v in enumerate(s.response_versions):
                if v == version:
                    assert s.response_logprobs[i] == pytest.approx(float(ref[i]), abs=1e-4)
                    num_checked += 1
    assert mixed > 0 and num_checked == sum(len(s.response_ids) for s in flatten(finished))


def test_resumed_responses_are_token_identical_continuations(servers, checkpoints, tokenizer):
    urls = [h.url for h in servers]
    greedy = SamplingConfig(temperature=0.0, ignore_eos=True)
    with RolloutClient(RolloutClientConfig(urls=urls)) as client:
        client.update_weights_from_disk(checkpoints[0], 20)  # the same weights on both servers
        whole = PartialRolloutManager(client, PartialRolloutConfig(group_size=2, max_response_tokens=24,
                                                                   sampling=greedy))
        pieces = PartialRolloutManager(client, PartialRolloutConfig(group_size=2, max_response_tokens=24,
                                                                    segment_tokens=5, sampling=greedy))
        prompts = make_prompts(tokenizer, 3)
        ref = {g.prompt.index: g for g in whole.step(prompts, 20).groups}
        got = pieces.step(prompts, 20).groups
        assert got == []
        while pieces.buffer:
            got += pieces.step([], 20).groups
    assert len(got) == 3
    for g in got:
        for s, r in zip(g.samples, ref[g.prompt.index].samples):
            assert s.num_segments == 5 and r.num_segments == 1
            assert s.response_ids == r.response_ids and len(s.response_ids) == 24
            assert s.response_logprobs == pytest.approx(r.response_logprobs, abs=1e-4)


def _running(url: str) -> int:
    try:
        data = json.loads(urllib.request.urlopen(f"{url}/v1/loads", timeout=2).read())
    except OSError:
        return 0
    return sum(x.get("num_running_reqs", 0) for x in data["loads"])


def test_kill_one_of_two_servers_mid_rollout(servers, tokenizer):
    """Runs last in this module: it kills the first server."""
    urls = [h.url for h in servers]
    victim = servers[0]
    cfg = PartialRolloutConfig(group_size=4, max_response_tokens=120, sampling=SamplingConfig(ignore_eos=True))

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while _running(victim.url) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)

    with RolloutClient(RolloutClientConfig(urls=urls, backoff_s=0.1)) as client:
        manager = PartialRolloutManager(client, cfg)
        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        groups = manager.step(make_prompts(tokenizer, 4), 20).groups
        killer.join()
        assert victim.proc.wait(timeout=30) == -signal.SIGKILL
        assert client.stats["num_retries"] > 0  # requests on the dead server were re-sent
        assert client.healthy_urls() == [urls[1]]
    assert len(groups) == 4 and not manager.buffer
    for s in flatten(groups):
        assert len(s.response_ids) == 120 and s.state is SampleState.TRUNCATED
        assert len(s.response_logprobs) == 120 and set(s.response_versions) == {20}


@pytest.fixture
def fresh_servers(checkpoints):
    """Two servers of this test's own (the module's pair may have one killed by an earlier test)."""
    with _server_pair(checkpoints[0]) as handles:
        yield handles


@pytest.mark.slow
def test_seeded_requests_sample_the_same_whatever_the_order(fresh_servers, checkpoints, tokenizer):
    """PartialRolloutManager(seed=...): every segment carries its own sampling_seed, so the responses do
    not depend on which requests share a server batch or reach it first (nor on a restart)."""
    urls = [h.url for h in fresh_servers]

    def run(seed, prompts):
        cfg = PartialRolloutConfig(group_size=3, max_response_tokens=8, segment_tokens=4, max_staleness=None,
                                   sampling=SamplingConfig(temperature=1.0))
        with RolloutClient(RolloutClientConfig(urls=urls, max_concurrency=4)) as client:
            client.update_weights_from_disk(checkpoints[0], 0)
            manager, out = PartialRolloutManager(client, cfg, seed=seed), {}
            for step in range(4):
                for g in manager.step(prompts if step == 0 else [], 0).groups:
                    out[g.prompt.index] = [s.response_ids for s in g.samples]
        return out

    prompts = make_prompts(tokenizer, 4)
    first = run(7, prompts)
    again = run(7, list(reversed(prompts)))  # other order, other batching, other server per request
    other = run(8, prompts)
    assert first == again and len(first) == 4
    assert first != other
    assert any(len({tuple(r) for r in group}) > 1 for group in first.values())  # samples of a group differ
