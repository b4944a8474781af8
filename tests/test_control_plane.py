"""The rollout control plane at scale, rehearsed on a CPU against the built-in server (issue: syncs
without tails, concurrency that fits the KV cache, long responses that finish).

1. A sync leaves no tail: under an "abort" pause, requests still waiting in the client are not sent;
   nothing runs a segment on the new weights in the round the pause ended (at 1b21a04 they were sent
   after continue and each ran a whole segment while the trainer waited). Only a round the pause
   left without a finished group goes on, on the new weights, until one finishes.
2. Concurrency follows the servers: by default the client keeps no more requests in flight per
   server than its KV cache holds for this run's requests; a configured value that cannot fit warns
   once with the numbers (at 1b21a04: 256 in flight whatever the cache).
3. Long responses finish: staleness is judged per token at training time (`mask_stale_tokens`), and
   BAPO's bound search sees exactly the tokens the loss trains. The probe workload (96-token responses in 8-token segments, rollout one
   step ahead, an "abort" pause at every sync, a slowed server so that syncs cut segments) updates
   on >= 90% of its steps after warm-up, regenerates < 5% of the tokens it generates, and trains
   full-length responses (at 1b21a04 the stale groups were regenerated again and again).
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient,
                                   RolloutClientConfig, SamplingConfig, flatten)
from megatron_bapo.server.launch import start_server
from sglang_proxy import RecordingProxy


def _prompts(n: int, length: int = 4) -> list[Prompt]:
    return [Prompt(prompt_ids=[5 + i] + [7] * (length - 1), index=i) for i in range(n)]


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tmp_path_factory):
    with start_server(tiny_hf_dir, log_path=tmp_path_factory.mktemp("cp") / "server.log") as handle:
        yield handle


def _start_round(client, manager, prompts):
    """Start `manager.astep` on the client's loop; return once the first segment came back and the
    rest wait in the client (2 at a time)."""
    running = client.submit(manager.astep(prompts, 0))
    deadline = time.monotonic() + 60
    while client.stats["num_requests"] < 3:
        assert time.monotonic() < deadline and not running.done()
        time.sleep(0.005)
    return running


def test_an_abort_pause_sends_nothing_more_in_the_round_it_ends(server, tiny_hf_dir):
    """16 one-sample groups of 64 tokens, 2 requests at a time; an "abort" pause and a weight update
    (version 1) come while most requests still wait in the client. The round has a finished group,
    so it ends at the pause: nothing is sent after the pause began, and every token of the round is
    version 0. The next round sends every unfinished sample, on version 1."""
    cfg = PartialRolloutConfig(group_size=1, max_response_tokens=64, segment_tokens=64, max_staleness=None,
                               sampling=SamplingConfig(ignore_eos=True))
    with RolloutClient(RolloutClientConfig(urls=[server.url], max_concurrency=2)) as client:
        client.update_weights_from_disk(str(tiny_hf_dir), 0)
        manager = PartialRolloutManager(client, cfg)
        running = _start_round(client, manager, _prompts(16))
        client.pause_generation("abort")
        sent = client.stats["num_requests"]
        client.update_weights_from_disk(str(tiny_hf_dir), 1)
        client.continue_generation()
        running.result(120)
        assert client.stats["num_requests"] == sent, "requests were sent after the pause began (a tail)"
        samples = flatten(manager.buffer)
        versions = {v for s in samples for v in s.response_versions}
        assert versions <= {0}, f"segments ran on the new weights in the round the pause ended: {versions}"
        assert len([s for s in samples if not s.response_ids]) >= 8  # most never left the client
        manager.step([], 1)  # the next round: every unfinished sample goes out, on version 1
        for s in flatten(manager.buffer):
            assert s.response_ids and s.response_versions[-1] == 1


def test_a_round_an_abort_pause_cut_before_any_group_finished_goes_on(server, tiny_hf_dir):
    """The same pause, but no group has finished when it comes (4 samples per group): the round is
    not handed over empty; after continue its samples go on, on version 1, until a group finishes."""
    cfg = PartialRolloutConfig(group_size=4, max_response_tokens=64, segment_tokens=64, max_staleness=None,
                               sampling=SamplingConfig(ignore_eos=True))
    with RolloutClient(RolloutClientConfig(urls=[server.url], max_concurrency=2)) as client:
        client.update_weights_from_disk(str(tiny_hf_dir), 0)
        manager = PartialRolloutManager(client, cfg)
        running = _start_round(client, manager, _prompts(4))
        client.pause_generation("abort")
        client.update_weights_from_disk(str(tiny_hf_dir), 1)
        client.continue_generation()
        done = running.result(120)
        assert done.groups and done.metrics["rollout/num_passes_after_pause"] == 1
        versions = {v for g in done.groups for s in g.samples for v in s.response_versions}
        assert versions == {0, 1} or versions == {1}, versions  # continued on the new weights
        assert all(len(s.response_ids) == 64 for g in done.groups for s in g.samples)


def test_no_short_round_follows_a_checkpoint(server, tiny_hf_dir):
    """A checkpoint pauses the producer with abort while the round of the next step is in flight
    (rollout one step ahead, `dynamic_sampling: off`). 16 one-sample groups of 64 tokens in one
    segment each, 2 requests at a time: uninterrupted, the round finishes all 16. The checkpoint's
    state holds the cut step; both the producer that goes on and one restored from that state hand
    over all 16 groups with whole responses (at b74de61 the round the abort ended was handed over
    with the 1-3 groups finished before it)."""
    from megatron_bapo.rollout.dynamic_sampling import DynamicSampler, in_flight_of, manager_round, requeue_into
    from megatron_bapo.rollout.producer import RolloutProducer

    cfg = PartialRolloutConfig(group_size=1, max_response_tokens=64, segment_tokens=64, max_staleness=None,
                               sampling=SamplingConfig(ignore_eos=True))

    def sampler_for(manager, todo):
        return DynamicSampler(mode="off", prompts_per_step=16, max_refill_rounds=1,
                              draw=lambda n: [todo.pop(0) for _ in range(min(n, len(todo)))],
                              advance=manager_round(manager), requeue=requeue_into(manager),
                              score=lambda groups: None, in_flight=in_flight_of(manager))

    def whole(done):
        return len(done.groups) == 16 and all(len(s.response_ids) == 64 for s in flatten(done.groups))

    with RolloutClient(RolloutClientConfig(urls=[server.url], max_concurrency=2)) as client:
        client.update_weights_from_disk(str(tiny_hf_dir), 0)
        manager = PartialRolloutManager(client, cfg)
        sampler = sampler_for(manager, _prompts(16))
        producer = RolloutProducer(client, manager, sampler.produce, ahead=1, served_version=lambda: 0,
                                   interrupt=sampler.interrupt)
        producer.start()  # one round ahead: it starts before the trainer asks
        deadline = time.monotonic() + 60
        while client.stats["num_requests"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        producer.pause(abort=True)  # the checkpoint
        state = {"rollout": manager.state_dict(), "rounds": producer.state_dict(), "sampling": sampler.state_dict()}
        producer.resume()
        done, _ = producer.next()
        producer.stop()
        assert whole(done), f"{len(done.groups)} groups handed over after the checkpoint"

        restored = PartialRolloutManager(client, cfg)  # a run resumed from that checkpoint
        restored.load_state_dict(state["rollout"])
        again = sampler_for(restored, [])
        again.load_state_dict(state["sampling"])
        assert state["sampling"]["step"]["cut"] and not state["rounds"]["ready"]
        assert whole(client.run(again.produce(0)))


@pytest.mark.slow
def test_concurrency_follows_the_servers_kv_cache(tiny_hf_dir, tmp_path, caplog):
    """A server with 400 tokens of KV (`--max-total-tokens`), requests of a 4-token prompt and up to
    64 tokens in 16-token segments (4 + 16 x 5 / 2 = 44 KV tokens at a segment's end, on average):
    400 // 44 = 9 in flight at most, by default. A configured 64 is kept and warned about, once."""
    cfg = PartialRolloutConfig(group_size=8, max_response_tokens=64, segment_tokens=16, max_staleness=None,
                               sampling=SamplingConfig(ignore_eos=True))
    with start_server(tiny_hf_dir, extra_args=["--max-total-tokens", "400"], log_path=tmp_path / "s.log") as srv:
        with RecordingProxy(srv.url) as proxy:
            with RolloutClient(RolloutClientConfig(urls=[proxy.url])) as client:
                manager = PartialRolloutManager(client, cfg)
                manager.step(_prompts(4), 0)  # 32 requests
                manager.step([], 0)
            assert 2 <= proxy.peak_generate <= 9, proxy.peak_generate
            proxy.peak_generate = 0
            with caplog.at_level(logging.WARNING, logger="megatron_bapo.rollout"):
                with RolloutClient(RolloutClientConfig(urls=[proxy.url], max_concurrency=64)) as client:
                    manager = PartialRolloutManager(client, cfg)
                    manager.step(_prompts(4), 0)
                    manager.step([], 0)
                    manager.step(_prompts(1, length=5), 0)  # longer prompts: sized again, not warned again
            assert proxy.peak_generate > 9  # the configured value wins
    warnings = [r.getMessage() for r in caplog.records if "max_concurrency" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "rollout.client.max_concurrency=64" in warnings[0] and "400 tokens" in warnings[0] and "44 tokens" in warnings[0]


@pytest.mark.slow
def test_long_responses_finish_on_the_probe_workload(tiny_hf_dir, tmp_path):
    """The probe of the issue, shortened: every response runs to 96 tokens (ignore_eos) in 8-token
    segments, one step ahead, each sync an "abort" pause; the server is slowed (2 ms per generation
    step) so that syncs cut segments as they do at 64k. After warm-up (13 steps: 12 segments + 1
    ahead) at least 90% of the steps update, under 5% of the generated tokens are regenerated, and
    the trained responses are full length."""
    from run_helpers import finish, run_config, start_train, write_assets

    (tmp_path / "assets").mkdir()
    assets = (write_assets(tmp_path / "assets"), tiny_hf_dir)
    out = tmp_path / "probe"
    steps = 34
    config = run_config(assets, out, total_steps=steps, save_every=0, eval_at_start=False, async_steps=1,
                        max_steps_without_update=0, sections={
                            "rollout": {"group_size": 4, "prompts_per_step": 4, "max_response_tokens": 96,
                                        "segment_tokens": 8, "max_staleness": 12, "builtin_server_decode_delay_ms": 2.0,
                                        "sampling": {"ignore_eos": True}, "client": {"health_timeout_s": 180}},
                            "sync": {"pause_mode": "abort"}, "eval": {"every_n_steps": 0}})
    proc = start_train(config, assets)
    log = finish(proc, timeout=900)
    assert proc.returncode == 0, log[-4000:]
    records = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    records = [r for r in records if "timing/step_s" in r]
    assert len(records) == steps
    after = records[13:]
    updated = sum(r["train/updated"] for r in after)
    assert updated >= 0.9 * len(after), [r["train/updated"] for r in records]
    generated = sum(r["rollout/num_tokens_generated"] for r in records)
    regenerated = sum(r.get("rollout/num_regenerated_tokens", 0.0) for r in records)
    assert regenerated < 0.05 * generated, (regenerated, generated)
    assert any(r.get("rollout/num_aborted_segments", 0) for r in records)  # syncs did cut segments
    trained = [r for r in after if r["train/updated"]]
    assert all(r["rollout/response_len_mean"] == 96 for r in trained)


def _stale_tokens(rank, world_size):
    import torch

    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.algorithms import search_clip_bounds
    from megatron_bapo.rollout.batch import mask_stale_tokens
    from test_actor_helpers import TINY_QWEN2, make_batch

    actor = Actor(ActorConfig(), TINY_QWEN2)
    b = make_batch(num_seqs=6, seed=5)
    current = actor.compute_logprobs(b)
    b["behavior_logprobs"] = current.clone()  # ratio 1 everywhere: only the advantages decide
    width = b["advantages"].shape[1]
    adv = torch.tensor([-3.0, -3.0, -3.0, 1.0, -0.5, -0.5])[:, None].expand(6, width)
    b["advantages"] = adv * b["loss_mask"]
    b["versions"] = torch.full(b["loss_mask"].shape, 10, dtype=torch.long)
    b["versions"][:3] = 4  # rows 0-2: 6 versions behind the weights that train them
    original = b["loss_mask"].clone()
    masked = mask_stale_tokens(b, current_version=10, max_staleness=2)

    def searched(mask):
        keep = (mask > 0) & (torch.arange(mask.shape[1]) > 0)  # position 0 predicts nothing
        ratio = torch.exp(current[keep] - b["behavior_logprobs"][keep])
        res = search_clip_bounds(ratio, adv[keep], torch.ones_like(ratio), actor.config.bapo)
        return res.c_low, res.c_high

    metrics = actor.train_step(b, current_version=10)
    return {"masked": masked, "stale": float(original[:3].sum()), "left": float(b["loss_mask"][:3].sum()),
            "adv_left": float(b["advantages"][:3].abs().sum()), "fresh_kept": bool((b["loss_mask"][3:] == original[3:]).all()),
            "fresh": searched(b["loss_mask"]), "counted": searched(original),
            "chosen": (metrics["bapo/c_low"], metrics["bapo/c_high"])}


def test_stale_tokens_leave_the_loss_and_the_search_together(run_dist):
    """Per-token staleness at training time: tokens more than max_staleness versions behind leave the
    loss mask, and BAPO's bound search (which reads the same mask) chooses the bounds of the fresh
    tokens alone. The stale tokens here are heavy negatives that would move the bounds to the end
    of their grids if the search counted them."""
    pytest.importorskip("megatron.core")
    res = run_dist(_stale_tokens, 1, timeout=120)[0]
    assert res["masked"]["staleness/num_masked_tokens"] == res["stale"] > 0
    assert 0 < res["masked"]["staleness/frac_masked_tokens"] < 1
    assert res["left"] == 0 and res["adv_left"] == 0 and res["fresh_kept"]
    assert res["counted"] != res["fresh"]  # the stale tokens would have moved the bounds
    assert res["chosen"] == pytest.approx(res["fresh"])
