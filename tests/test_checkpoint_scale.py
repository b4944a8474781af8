"""Checkpoints that do not stall a 128-rank job on rank 0 (issue 35): the rollout buffer is written
in binary and restored exactly (`state_io`), every rank hashes the files it wrote and the ranks
verify a checkpoint in parallel, agreeing on the first bad file (`manifest`), old checkpoints are
deleted in the background (`run_state.prune_checkpoints`). Real files, real gloo ranks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_bapo import manifest, run_state, state_io
from megatron_bapo.rollout.types import Prompt, RolloutGroup, Sample, SampleState


def _buffer(num_groups: int = 3, tokens: int = 500) -> list[RolloutGroup]:
    rng = random.Random(0)
    groups = []
    for g in range(num_groups):
        samples = [Sample(prompt_ids=[rng.randrange(150_000) for _ in range(40)],
                          response_ids=[rng.randrange(150_000) for _ in range(tokens)],
                          response_logprobs=[-rng.random() * 20 for _ in range(tokens)],
                          response_versions=[rng.randrange(5) for _ in range(tokens)], state=SampleState.PARTIAL,
                          routed_experts=bytes(range(10)), routed_width=2)
                   for _ in range(4)]
        groups.append(RolloutGroup(group_id=f"g{g}", prompt=Prompt(prompt_ids=[1, 2, 3], answer="7", index=g),
                                   samples=samples, start_version=g))
    return groups


def test_buffer_round_trips_exactly_through_the_binary_side_file(tmp_path):
    groups = _buffer()
    state = {"rollout": {"format": 1, "groups": [g.to_dict() for g in groups], "totals": {"n": 3}}, "step": 4}
    state_io.dump_state(tmp_path / "trainer.json", state)
    assert (tmp_path / state_io.ARRAYS_FILE).stat().st_size >= 3 * 4 * 500 * (4 + 8 + 4)  # ids, log-probs, versions
    assert (tmp_path / "trainer.json").stat().st_size < 40_000, "the long lists stayed in the JSON"
    back = state_io.load_state(tmp_path / "trainer.json")
    assert back == json.loads(json.dumps(state))  # every float bit-exact, ints stay ints
    restored = [RolloutGroup.from_dict(g) for g in back["rollout"]["groups"]]
    assert [g.to_dict() for g in restored] == [g.to_dict() for g in groups]


def test_files_belong_to_the_rank_that_wrote_them():
    assert manifest.owner_of("actor/__3_0.distcp", 8) == 3
    assert manifest.owner_of("actor/__11_1.distcp", 8) == 3  # resumed with fewer ranks: shared out
    assert manifest.owner_of("actor/rng/rank5.pt", 8) == 5
    for rel in ("actor/.metadata", "actor/common.pt", "trainer.json", state_io.ARRAYS_FILE, "actor/actor_meta.json"):
        assert manifest.owner_of(rel, 8) == 0


def _fake_checkpoint(root: Path, world: int) -> Path:
    ckpt = run_state.checkpoint_dir(root, 2)
    (ckpt / "actor" / "rng").mkdir(parents=True)
    for r in range(world):
        (ckpt / "actor" / f"__{r}_0.distcp").write_bytes(bytes([r]) * (100_000 + r))
        (ckpt / "actor" / "rng" / f"rank{r}.pt").write_bytes(bytes([r]) * 10)
    (ckpt / "actor" / ".metadata").write_bytes(b"meta")
    return ckpt


def _save_and_verify(rank, world, root):
    import torch.distributed as dist

    group = dist.group.WORLD
    ckpt = run_state.checkpoint_dir(root, 2)
    if rank == 0:
        run_state.write_trainer_state(ckpt, {"step": 2, "version": 2})
    dist.barrier(group=group)
    own = run_state.hash_own_files(ckpt, rank, world)
    parts = [None] * world
    dist.all_gather_object(parts, own, group=group)
    if rank == 0:
        run_state.finish_checkpoint(ckpt, {rel: h for p in parts for rel, h in p.items()})
    dist.barrier(group=group)
    ok = run_state.latest_checkpoint(root, group=group)
    dist.barrier(group=group)
    if rank == 0:  # bytes of rank 1's shard change on disk, same size
        path = ckpt / "actor" / "__1_0.distcp"
        path.write_bytes(b"\xff" + path.read_bytes()[1:])
    dist.barrier(group=group)
    reason = manifest.verify_checkpoint(ckpt, group=group)
    return sorted(own), str(ok), reason


def test_every_rank_hashes_its_own_files_and_the_ranks_verify_in_parallel(tmp_path):
    from dist_harness import run_dist

    ckpt = _fake_checkpoint(tmp_path, 2)
    results = run_dist(_save_and_verify, 2, tmp_path, timeout=120)
    own0, own1 = results[0][0], results[1][0]
    assert own1 == ["actor/__1_0.distcp", "actor/rng/rank1.pt"]
    assert "trainer.json" in own0 and "actor/__0_0.distcp" in own0 and not set(own0) & set(own1)
    written = json.loads((ckpt / run_state.MANIFEST).read_text())["files"]
    assert sorted(written) == sorted(own0 + own1)
    for rel, entry in written.items():  # the merged manifest is what one process would have hashed
        if rel != "actor/__1_0.distcp":
            assert run_state.hash_file(ckpt / rel) == (entry["size"], entry["sha256"])
    assert [r[1] for r in results] == [str(ckpt)] * 2
    assert [r[2] for r in results] == ["actor/__1_0.distcp does not match its sha256 in the manifest (bytes "
                                       "changed on disk)"] * 2


def test_old_checkpoints_are_deleted_in_the_background(tmp_path):
    for step in (1, 2, 3):
        ckpt = run_state.checkpoint_dir(tmp_path, step)
        ckpt.mkdir(parents=True)
        run_state.save_trainer_state(ckpt, {"step": step})
    leftover = tmp_path / "checkpoints" / run_state.DELETING / "step_000000.1.1"
    leftover.mkdir(parents=True)  # a killed run's unfinished deletion
    thread = run_state.prune_checkpoints(tmp_path, keep=1)
    # At return the old ones are no step directories any more (a resume cannot pick them) ...
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000003"]
    thread.join(timeout=30)
    # ... and once the thread is done, nothing of them is left.
    assert list((tmp_path / "checkpoints" / run_state.DELETING).iterdir()) == []
    assert run_state.latest_checkpoint(tmp_path) == run_state.checkpoint_dir(tmp_path, 3)


@pytest.mark.slow
def test_a_checkpoint_aborts_the_round_in_flight_and_keeps_its_tokens(tiny_hf_dir, tmp_path):
    """Rollout one round ahead, each response 400 tokens in one segment: the checkpoint's pause does not
    wait for the round to finish. Its requests are aborted; every response keeps the tokens it has
    (ABORTED, a partial rollout the next round resumes), none is lost."""
    import time
    import urllib.request

    from megatron_bapo.rollout import PartialRolloutConfig, PartialRolloutManager, RolloutClient, RolloutClientConfig
    from megatron_bapo.rollout.config import SamplingConfig
    from megatron_bapo.rollout.dynamic_sampling import rollout_round
    from megatron_bapo.rollout.producer import RolloutProducer
    from megatron_bapo.server.launch import start_server

    server = start_server(tiny_hf_dir, log_path=tmp_path / "server.log")
    client = RolloutClient(RolloutClientConfig(urls=[server.url]))
    try:
        config = PartialRolloutConfig(group_size=4, max_response_tokens=400, segment_tokens=400, max_staleness=None,
                                      sampling=SamplingConfig(ignore_eos=True))
        manager = PartialRolloutManager(client, config)
        prompts = [Prompt(prompt_ids=[5 + i, 6, 7], index=i) for i in range(4)]
        producer = RolloutProducer(client, manager, rollout_round(manager, lambda: prompts), ahead=1,
                                   served_version=lambda: 0)
        producer.start()

        def generated() -> int:
            load = json.loads(urllib.request.urlopen(server.url + "/v1/loads", timeout=10).read())["loads"][0]
            return load["num_used_tokens"] - 3 * load["num_running_reqs"]

        deadline = time.monotonic() + 120
        while generated() < 16 * 5:  # every request runs and has some tokens
            assert time.monotonic() < deadline, "the round did not start"
            time.sleep(0.05)
        producer.pause(abort=True)
        samples = [s for g in manager.buffer for s in g.samples]
        assert len(samples) == 16, "a response was lost"
        assert all(s.state == SampleState.ABORTED and 0 < len(s.response_ids) < 400 for s in samples), \
            [(s.state, len(s.response_ids)) for s in samples]
        kept = sum(len(s.response_ids) for s in samples)
        assert kept >= 16 * 5
        state = manager.state_dict()  # what the checkpoint saves: the partial tokens with their log-probs
        assert sum(len(s["response_ids"]) for g in state["groups"] for s in g["samples"]) == kept
        assert not producer.state_dict()["ready"][0]["groups"]  # the aborted round finished no group
    finally:
        producer.stop()
        client.close()
        server.stop()
