"""Rank 0's share of a checkpoint save and resume against the other ranks', with a large in-flight
rollout buffer: the code before issue 35 against now, measured in one run on the same files.

What each rank does after the actor's shards are written (the actor's own write is the same before
and after and is not timed), until every rank may go on:
- before (`megatron_bapo/run_state.py` at 1b21a04, loaded from git into this process): rank 0 writes
  trainer.json with the partial-rollout buffer as JSON, sha256-hashes every file of the checkpoint
  and deletes the previous checkpoint, while the other ranks wait in a broadcast; at resume rank 0
  hashes every file again while the others wait, then every rank parses the whole JSON.
- after (this tree): rank 0 writes trainer.json with the buffer in a binary side file
  (`state_io`), every rank hashes the files it wrote (`manifest.hash_own_files`), rank 0 merges the
  manifest and hands the old checkpoint to a background thread; at resume every rank hashes its
  share, and only rank 0 reads the buffer.

The buffer is `--samples` responses of `--tokens` tokens each (token ids, behavior log-probs and
versions per token, as `rollout.partial` keeps them); every rank writes a shard of `--shard-mb`.
Forked gloo ranks on one machine: on a 2-core box the ranks' hashing shares two cores, so the
parallel hashing shows as rank 0 hashing 1/N of the bytes, not as N times less wall time (on a
cluster each rank reads from its own node).

    python benchmarks/bench_checkpoint.py [--ranks 4 --shard-mb 128 --samples 128 --tokens 16384]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

ROOT = Path(__file__).resolve().parents[1]
BEFORE_COMMIT = "1b21a04"


def old_run_state(workdir: Path):
    """`megatron_bapo/run_state.py` as it was at BEFORE_COMMIT, as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE_COMMIT}:megatron_bapo/run_state.py"],
                            capture_output=True, text=True, check=True).stdout
    path = workdir / "run_state_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("run_state_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_state(samples: int, tokens: int, seed: int = 0) -> dict:
    """A trainer state whose partial-rollout buffer holds `samples` responses of `tokens` tokens."""
    rng = random.Random(seed)
    group_size = 8
    groups = []
    for g in range(max(1, samples // group_size)):
        group = []
        for _ in range(group_size):
            group.append({"prompt_ids": [rng.randrange(150_000) for _ in range(256)],
                          "response_ids": [rng.randrange(150_000) for _ in range(tokens)],
                          "response_logprobs": [-rng.random() * 10 for _ in range(tokens)],
                          "response_versions": [rng.randrange(8) for _ in range(tokens)], "state": "partial",
                          "finish_reason": None, "num_segments": 1, "num_regenerations": 0, "error": None,
                          "reward": None, "routed_experts": "", "routed_width": 0})
        groups.append({"group_id": f"g{g}", "prompt": {"prompt_ids": [1, 2], "answer": "1", "index": g,
                                                        "metadata": {}}, "samples": group, "start_version": 3})
    return {"step": 10, "version": 10, "data": {"epoch": 0, "position": 80},
            "rollout": {"format": 1, "groups": groups, "totals": {}}, "rounds": {"ready": [], "unrecorded": []}}


def write_shards(ckpt: Path, rank: int, shard_mb: int) -> None:
    actor = ckpt / "actor"
    (actor / "rng").mkdir(parents=True, exist_ok=True)
    with open(actor / f"__{rank}_0.distcp", "wb") as f:
        block = os.urandom(1 << 20)
        for _ in range(shard_mb):
            f.write(block)
    (actor / "rng" / f"rank{rank}.pt").write_bytes(os.urandom(4096))
    if rank == 0:
        (actor / ".metadata").write_bytes(os.urandom(1 << 16))
        (actor / "common.pt").write_bytes(os.urandom(1 << 12))


def _worker(rank: int, world: int, root: str, args, out_q) -> None:
    import torch.distributed as dist

    from megatron_bapo import run_state

    group = dist.group.WORLD
    root = Path(root)
    old = old_run_state(root / f"mod{rank}")
    state = make_state(args.samples, args.tokens) if rank == 0 else None
    times = {}
    for variant in ("before", "after"):
        out = root / variant
        for step in (2, 4):  # step 2 exists (and is pruned at the step-4 save with keep_checkpoints=1)
            ckpt = run_state.checkpoint_dir(out, step)
            if rank == 0:
                ckpt.mkdir(parents=True, exist_ok=True)
            dist.barrier(group=group)
            write_shards(ckpt, rank, args.shard_mb if step == 4 else 1)
            dist.barrier(group=group)
            start = time.monotonic()
            if variant == "before":
                failed = None
                if rank == 0:
                    old.save_trainer_state(ckpt, state)
                    old.prune_checkpoints(out, 1)
                box = [failed]
                dist.broadcast_object_list(box, group=group, group_src=0)
            else:
                if rank == 0:
                    run_state.write_trainer_state(ckpt, state)
                box = [None]
                dist.broadcast_object_list(box, group=group, group_src=0)
                own = run_state.hash_own_files(ckpt, rank, world)
                parts = [None] * world
                dist.all_gather_object(parts, own, group=group)
                if rank == 0:
                    run_state.finish_checkpoint(ckpt, {r: h for p in parts for r, h in p.items()})
                    run_state.prune_checkpoints(out, 1)
                dist.broadcast_object_list(box, group=group, group_src=0)
            if step == 4:
                times[f"save_{variant}"] = time.monotonic() - start
        dist.barrier(group=group)
        start = time.monotonic()
        if variant == "before":
            found = old.resume_checkpoint(out, group=group)
            loaded = old.load_trainer_state(found)
        else:
            found = run_state.resume_checkpoint(out, group=group)
            loaded = run_state.load_trainer_state(found, full=rank == 0)
        dist.barrier(group=group)  # the ranks go on together (the trainer's next collective)
        times[f"resume_{variant}"] = time.monotonic() - start
        assert int(loaded["step"]) == 10
        if rank == 0:
            assert loaded["rollout"]["groups"][0]["samples"][3]["response_logprobs"] == \
                state["rollout"]["groups"][0]["samples"][3]["response_logprobs"]
            times[f"trainer_bytes_{variant}"] = sum(p.stat().st_size for p in found.iterdir() if p.is_file())
    out_q.put((rank, times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=128)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()

    import multiprocessing as mp

    from dist_harness import free_port

    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    for rank in range(args.ranks):
        (root / f"mod{rank}").mkdir()
    ctx = mp.get_context("fork")
    out_q = ctx.Queue()
    port = free_port()

    def run(rank: int) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
        try:
            _worker(rank, args.ranks, str(root), args, out_q)
        finally:
            dist.destroy_process_group()

    procs = [ctx.Process(target=run, args=(r,)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = dict(out_q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    shutil.rmtree(root, ignore_errors=True)
    values = args.samples * args.tokens * 3
    print(f"{args.ranks} gloo ranks, a {args.shard_mb} MB shard each; buffer: {args.samples} responses x {args.tokens} "
          f"tokens ({values / 1e6:.1f}M values); seconds from the actor files written until every rank goes on")
    print(f"trainer state on disk: before {results[0]['trainer_bytes_before'] / 1e6:.0f} MB (JSON), after "
          f"{results[0]['trainer_bytes_after'] / 1e6:.0f} MB (JSON + binary)")
    print(f"{'':16}{'rank 0':>10}{'others (max)':>14}{'others (min)':>14}")
    for phase in ("save", "resume"):
        for variant in ("before", "after"):
            key = f"{phase}_{variant}"
            others = [results[r][key] for r in results if r != 0] or [float("nan")]
            print(f"{phase + ' ' + variant:16}{results[0][key]:>10.2f}{max(others):>14.2f}{min(others):>14.2f}")
        print(f"{phase + ' speedup':16}{results[0][phase + '_before'] / results[0][phase + '_after']:>9.1f}x")


if __name__ == "__main__":
    main()
