"""Rollout client and partial-rollout manager over real loopback HTTP against the deterministic
stand-in server (`tests/fake_server.py`, separate processes), so every token, log-prob
and version received can be recomputed and checked exactly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RequestRejected,
                                   RolloutClient, RolloutClientConfig, RolloutError, SampleState,
                                   SamplingConfig, build_batch, flatten)
from fake_server import EOS_ID, ThreadedFakeServer, next_token, token_logprob, weights_seed
from dist_harness import free_port



@contextlib.contextmanager
def fake_servers(n: int = 1, **flags):
    """n in-process stand-in servers on loopback ports (threads: cheap to start)."""
    servers = [ThreadedFakeServer(**flags) for _ in range(n)]
    try:
        yield [s.url for s in servers], servers
    finally:
        for s in servers:
            s.stop()


@contextlib.contextmanager
def fake_server_processes(n: int = 1, **flags):
    """n stand-in servers as separate processes (to be killed with SIGKILL)."""
    procs, urls = [], []
    try:
        for _ in range(n):
            port = free_port()
            cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "fake_server.py"), "--port", str(port)]
            for k, v in flags.items():
                cmd += [f"--{k.replace('_', '-')}", str(v)]
            procs.append(subprocess.Popen(cmd))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=2).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        yield urls, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def server_info(url: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{url}/get_server_info", timeout=5).read())


def client_for(urls, **kw) -> RolloutClient:
    kw.setdefault("backoff_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    return RolloutClient(RolloutClientConfig(urls=list(urls), **kw))


def prompts(n: int, length: int = 5) -> list[Prompt]:
    return [Prompt(prompt_ids=[(7 * i + j) % 60 + 2 for j in range(length)], answer=str(i), index=i) for i in range(n)]


def check_tokens(sample, seeds_by_version: dict[int, int]) -> None:
    """Every token and log-prob is what the server's weights of that token's version produce."""
    prefix = list(sample.prompt_ids)
    for tok, lp, v in zip(sample.response_ids, sample.response_logprobs, sample.response_versions):
        seed = seeds_by_version[v]
        assert tok == next_token(prefix, seed)
        assert lp == pytest.approx(token_logprob(prefix, tok, seed), abs=1e-12)
        prefix.append(tok)


def uninterrupted(prompt_ids, seed: int, max_tokens: int, ignore_eos: bool = False) -> list[int]:
    prefix, out = list(prompt_ids), []
    while len(out) < max_tokens:
        tok = next_token(prefix, seed)
        prefix.append(tok)
        out.append(tok)
        if tok == EOS_ID and not ignore_eos:
            break
    return out


def test_generate_parses_ids_logprobs_and_version():
    with fake_servers(1) as (urls, _), client_for(urls) as client:
        client.update_weights_from_disk("ckpt/a", 3)
        assert client.get_weight_version() == 3
        res = client.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 1.0})
        seed = weights_seed("ckpt/a")
        assert res.output_ids == uninterrupted([5, 6, 7], seed, 6)
        assert res.versions == [3] * len(res.output_ids)
        assert res.finish_type in ("stop", "length")
        assert len(res.rid) == 32 and res.url == urls[0]
        with pytest.raises(ValueError, match="unknown key"):
            client.generate([5], {"max_new_tokens": 2, "bogus": 1})
        with pytest.raises(RequestRejected) as err:
            client.generate([5], {"max_new_tokens": -1})
        assert err.value.status == 400 and "max_new_tokens" in str(err.value)
        assert client.stats["num_retries"] == 0  # a 4xx is never retried
        with pytest.raises(RolloutError, match="update_weights_from_disk"):
            client.update_weights_from_disk("/nonexistent/ckpt", 4)


def test_5xx_is_retried_with_backoff():
    with fake_servers(1, fail_first=2) as (urls, _), client_for(urls, unhealthy_cooldown_s=0) as client:
        res = client.generate([3, 4], {"max_new_tokens": 3})
        assert len(res.output_ids) >= 1
        assert client.stats["num_retries"] == 2
        assert server_info(urls[0])["num_generate"] == 3


def test_all_requests_in_flight_up_to_the_cap():
    with fake_servers(1, token_delay_s=0.05) as (urls, _), client_for(urls, max_concurrency=8) as client:
        cfg = PartialRolloutConfig(group_size=4, max_response_tokens=8,
                                   sampling=SamplingConfig(extra={"ignore_eos": True}))
        groups = PartialRolloutManager(client, cfg).step(prompts(5), 0).groups
        assert len(groups) == 5
        info = server_info(urls[0])
        assert info["num_generate"] == 20
        assert info["max_running"] == 8


def test_group_sampling_with_partial_rollout_across_weight_updates():
    seeds = {}
    with fake_servers(2) as (urls, _), client_for(urls) as client:
        cfg = PartialRolloutConfig(group_size=3, max_response_tokens=20, segment_tokens=4, max_staleness=None)
        manager = PartialRolloutManager(client, cfg)
        finished = []
        todo = prompts(6)
        for version in range(12):
            client.update_weights_from_disk(f"ckpt/v{version}", version)
            seeds[version] = weights_seed(f"ckpt/v{version}")
            finished += manager.step(todo[:2], version).groups
            todo = todo[2:]
            if not todo and not manager.buffer:
                break
        assert not manager.buffer
        assert sorted(g.prompt.index for g in finished) == list(range(6))
        mixed = 0
        for g in finished:
            assert len(g.samples) == 3
            for s in g.samples:
                check_tokens(s, seeds)
                assert s.state in (SampleState.COMPLETED, SampleState.TRUNCATED)
                assert (s.state is SampleState.COMPLETED) == (s.response_ids[-1] == EOS_ID)
                assert s.state is SampleState.COMPLETED or len(s.response_ids) == 20
                assert s.num_segments == -(-len(s.response_ids) // 4) or s.state is SampleState.COMPLETED
                assert s.response_versions == sorted(s.response_versions)
                mixed += len(set(s.response_versions)) > 1
        assert mixed > 0  # some responses really were resumed under a newer policy
        batch = build_batch(flatten(finished), pad_token_id=0)
        s0 = finished[0].samples[0]
        p, r = len(s0.prompt_ids), len(s0.response_ids)
        assert batch["versions"][0, p:p + r].tolist() == s0.response_versions


def test_versions_come_from_the_server_reply():
    with fake_servers(1) as (urls, _), client_for(urls) as client:
        client.update_weights_from_disk("ckpt/x", 7)
        manager = PartialRolloutManager(client, PartialRolloutConfig(group_size=2, max_response_tokens=5))
        groups = manager.step(prompts(2), version=3).groups  # the trainer believes 3; the server says 7
        assert {v for s in flatten(groups) for v in s.response_versions} == {7}


def test_stale_partial_samples_are_regenerated_past_the_hard_cap_not_mixed():
    """`max_group_staleness` (the hard cap): a buffered group whose oldest token is older is reset
    whole, counted in samples and tokens; a response is never a mix of a reset and an old part."""
    with fake_servers(1) as (urls, _), client_for(urls) as client:
        cfg = PartialRolloutConfig(group_size=4, max_response_tokens=16, segment_tokens=3, max_group_staleness=0,
                                   sampling=SamplingConfig(ignore_eos=True))
        manager = PartialRolloutManager(client, cfg)
        seeds, finished = {}, []
        for version in range(3):
            client.update_weights_from_disk(f"ckpt/s{version}", version)
            seeds[version] = weights_seed(f"ckpt/s{version}")
            finished += manager.step(prompts(2) if version == 0 else [], version).groups
        assert finished == []  # 16 tokens in segments of 3, restarted at each new version
        assert manager.totals["num_regenerated"] == 2 * 8
        assert manager.totals["num_regenerated_tokens"] == 2 * 8 * 3
        for s in flatten(manager.buffer):
            assert set(s.response_versions) == {2} and s.num_regenerations == 2
            check_tokens(s, seeds)
        for _ in range(5):
            finished += manager.step([], 2).groups
        assert len(finished) == 2 and all(len(set(s.response_versions)) == 1 for s in flatten(finished))


def test_hard_cap_holds_for_finished_samples_waiting_for_their_group():
    """A sample that finished early waits for its partial sibling; when the group is returned no
    token in it (the early sample's included) may be more than max_group_staleness versions old."""
    with fake_servers(1) as (urls, _), client_for(urls) as client:
        cfg = PartialRolloutConfig(group_size=2, max_response_tokens=6, segment_tokens=3, max_group_staleness=1,
                                   sampling=SamplingConfig(ignore_eos=True))
        manager = PartialRolloutManager(client, cfg)
        manager.step(prompts(1), 0).groups  # both samples: 3 tokens of version 0, partial
        early = manager.buffer[0].samples[0]
        early.state = SampleState.COMPLETED  # as if it had stopped on EOS at version 0
        groups = []
        for version in (2, 3):  # the policy moved on by 2 versions (e.g. steps without this group)
            client.update_weights_from_disk(f"ckpt/w{version}", version)
            groups += manager.step([], version).groups
        assert len(groups) == 1
        for s in groups[0].samples:
            assert 3 - min(s.response_versions) <= cfg.max_group_staleness, s.response_versions
            assert s.num_regenerations == 1  # the group restarted together at version 2
        assert manager.totals["num_regenerated"] == 2


def test_resumed_responses_equal_uninterrupted_and_state_dict_round_trips():
    with fake_servers(1) as (urls, _), client_for(urls) as client:
        seed = weights_seed("init")
        cfg = PartialRolloutConfig(group_size=2, max_response_tokens=30, segment_tokens=5)
        manager = PartialRolloutManager(client, cfg)
        finished = manager.step(prompts(4), 0).groups
        state = json.loads(json.dumps(manager.state_dict()))
        resumed = PartialRolloutManager(client, cfg)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == manager.state_dict()
        a, b = list(finished), list(finished)
        while manager.buffer or resumed.buffer:
            a += manager.step([], 0).groups
            b += resumed.step([], 0).groups
        key = lambda g: g.prompt.index  # noqa: E731
        assert [g.to_dict() for g in sorted(a, key=key)] == [g.to_dict() for g in sorted(b, key=key)]
        for g in a:
            for s in g.samples:
                assert s.response_ids == uninterrupted(s.prompt_ids, seed, 30)
        assert any(s.num_segments > 1 for g in a for s in g.samples)


def test_abort_mid_step_keeps_partial_tokens_and_resumes():
    with fake_servers(1, token_delay_s=0.02) as (urls, _), client_for(urls, max_concurrency=4) as client:
        cfg = PartialRolloutConfig(group_size=4, max_response_tokens=40,
                                   sampling=SamplingConfig(ignore_eos=True))
        manager = PartialRolloutManager(client, cfg)
        timer = threading.Timer(0.3, manager.abort)
        timer.start()
        cut = manager.step(prompts(3), 0)
        assert cut.groups == []
        timer.join()
        states = [s.state for s in flatten(manager.buffer)]
        assert set(states) == {SampleState.ABORTED}
        assert any(s.response_ids for s in flatten(manager.buffer))  # partial outputs kept
        assert cut.metrics["rollout/num_aborted_segments"] == 12
        groups = manager.step([], 0).groups
        assert len(groups) == 3
        for s in flatten(groups):
            assert s.response_ids == uninterrupted(s.prompt_ids, weights_seed("init"), 40, ignore_eos=True)
            assert s.state is SampleState.TRUNCATED


def test_killed_server_requests_complete_on_the_other():
    with fake_server_processes(2, token_delay_s=0.02) as (urls, procs), client_for(urls) as client:
        cfg = PartialRolloutConfig(group_size=4, max_response_tokens=25, sampling=SamplingConfig(ignore_eos=True))
        manager = PartialRolloutManager(client, cfg)
        killer = threading.Timer(0.25, lambda: os.kill(procs[0].pid, signal.SIGKILL))
        killer.start()
        groups = manager.step(prompts(6), 0).groups
        killer.join()
        assert procs[0].wait(timeout=10) == -signal.SIGKILL
        assert len(groups) == 6 and not manager.buffer
        for s in flatten(groups):
            assert s.response_ids == uninterrupted(s.prompt_ids, weights_seed("init"), 25, ignore_eos=True)
        assert client.stats["num_retries"] > 0
        assert client.healthy_urls() == [urls[1]]
        assert server_info(urls[1])["num_generate"] >= 12  # its half plus the re-queued ones


def test_every_server_down_raises_and_keeps_the_buffer():
    with fake_server_processes(1) as (urls, procs):
        client = client_for(urls, max_retries=2, connect_timeout_s=2)
        cfg = PartialRolloutConfig(group_size=2, max_response_tokens=30, segment_tokens=3)
        manager = PartialRolloutManager(client, cfg)
        manager.step(prompts(2), 0).groups
        before = manager.state_dict()
        procs[0].kill()
        procs[0].wait()
        with pytest.raises(RolloutError, match="failed on every server"):
            manager.step(prompts(1), 0).groups
        after = manager.state_dict()
        assert after["groups"][:2] == before["groups"]  # nothing lost, nothing changed
        assert len(after["groups"]) == 3
        client.close()


def test_pause_continue_and_flush_cache():
    with fake_servers(2) as (urls, _), client_for(urls) as client:
        client.wait_healthy(timeout_s=30)
        client.pause_generation()
        client.continue_generation()
        client.flush_cache()
        res = client.generate([9, 9], {"max_new_tokens": 2})
        assert res.output_ids


def test_context_limit_truncates_instead_of_overflowing():
    with fake_servers(1) as (urls, _), client_for(urls) as client:
        cfg = PartialRolloutConfig(group_size=2, max_response_tokens=20, segment_tokens=4, max_context_tokens=12,
                                   sampling=SamplingConfig(ignore_eos=True))
        manager = PartialRolloutManager(client, cfg)
        groups = manager.step(prompts(1, length=5), 0).groups + manager.step([], 0).groups
        assert len(groups) == 1
        for s in flatten(groups):
            assert len(s.response_ids) == 7 and s.state is SampleState.TRUNCATED and s.num_segments == 2


def test_router_generation_with_control_calls_to_each_worker():
    with fake_servers(2) as (workers, _):
        with ThreadedFakeServer(workers=workers) as router:
            with RolloutClient(RolloutClientConfig(router_url=router.url)) as client:
                client.update_weights_from_disk("ckpt/r", 5)
                assert [server_info(u)["weight_version"] for u in workers] == ["5", "5"]
                assert server_info(router.url)["weight_version"] == "default"  # never sent to the router
                res = client.generate([4, 4], {"max_new_tokens": 2})
                assert res.url == router.url and server_info(router.url)["num_generate"] == 1
                client.abort_all()
                client.pause_generation()
                client.continue_generation()


def test_producer_runs_ahead_and_hands_rounds_over_as_they_are():
    """RolloutProducer(ahead=2) keeps two rounds ready beyond the one the trainer asked for, labels
    new rounds with the version the servers serve (`served_version`), and hands every finished group
    over as it is: staleness is judged per token when it is trained (the driver's `mask_stale_tokens`),
    never by sending a finished group back."""
    from megatron_bapo.rollout.dynamic_sampling import rollout_round
    from megatron_bapo.rollout.producer import RolloutProducer

    with fake_servers(1) as (urls, _), client_for(urls) as client:
        cfg = PartialRolloutConfig(group_size=2, max_response_tokens=3, max_staleness=1,
                                   sampling=SamplingConfig(ignore_eos=True))
        manager = PartialRolloutManager(client, cfg)
        todo = prompts(8)
        served = [0]  # what the servers serve (the server pool's version in the trainer)
        producer = RolloutProducer(client, manager, rollout_round(manager, lambda: [todo.pop(0)]), ahead=2,
                                   served_version=lambda: served[0])
        client.update_weights_from_disk("ckpt/a0", 0)
        producer.start()
        first, _ = producer.next()
        assert [g.prompt.index for g in first.groups] == [0]
        deadline = time.monotonic() + 30
        while producer.produced < 3:  # rounds 2 and 3 run ahead of the trainer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        assert producer.produced == 3  # and no further: pacing holds it at two ahead
        client.update_weights_from_disk("ckpt/a5", 5)
        served[0] = 5
        second, _ = producer.next()  # generated at version 0: handed over as it is
        assert [g.prompt.index for g in second.groups] == [1] and [p.index for p in second.prompts] == [1]
        assert {v for s in flatten(second.groups) for v in s.response_versions} == {0}
        seen = {}
        for _ in range(4):
            done, _ = producer.next()
            for g in done.groups:
                seen[g.prompt.index] = {v for s in g.samples for v in s.response_versions}
        producer.stop()
    assert manager.totals["num_regenerated"] == 0
    assert seen[2] == {0} and seen[3] == seen[4] == seen[5] == {5}  # made ahead at 0; started after the update: 5


def test_a_health_check_refused_for_the_key_stops_at_once_naming_the_field():
    """A proxy that guards /health_generate with a key (SGLang itself leaves it open) answers 401:
    waiting cannot fix a key, so the wait ends at the first answer, naming client.api_key."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Guarded(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": "Unauthorized"}')

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Guarded)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = client_for([f"http://127.0.0.1:{httpd.server_address[1]}"], health_timeout_s=3)
    try:
        with pytest.raises(RolloutError, match=r"/health_generate refused the client's API key: 401 .*client\.api_key "
                                               r"\(or the ROLLOUT_API_KEY environment variable\)"):
            client.wait_healthy()
    finally:
        client.close()
        httpd.shutdown()
