"""Bytes (and time) to get one RL step's batch to the actor ranks: broadcast of the whole batch vs each
rank's own slice (`megatron_bapo.actor.scatter`).

Part 1, computed (no processes): a batch shaped like the 32B recipe's (rows of prompt + response,
lengths uniform in [--min-len, --max-len], right-padded to the longest as the driver builds it) is
cut for the recipe's layout (TP 8 x PP 2 x CP 2 x DP 2 = 64 ranks by default) exactly as rank 0
cuts it, and every distinct payload is serialised: bytes each rank receives and rank 0 sends,
against the pickled whole batch that `broadcast_object_list` sends to each of the other ranks. The
recipe has 1024 rows; the default 64 rows scale linearly (printed too).

Part 2, measured (`--measure-ranks N`, forked gloo ranks on loopback): wall time until every rank
holds its slice, for a smaller batch (--measure-seqs x --measure-len), DP x CP = N: the old broadcast
of the whole batch followed by each rank cutting its own slice, against `scatter_batch` (rank 0
cuts every slice). Loopback has far more bandwidth than a cluster's network, so this part shows
the CPU side; part 1's bytes are what the network carries.

    python benchmarks/bench_scatter.py [--seqs 64 --max-len 67584 --tp 8 --pp 2 --cp 2 --dp 2]
                                       [--measure-ranks 4 --measure-seqs 32 --measure-len 16384]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from megatron_bapo.actor.scatter import BatchSpec, PreparedBatch, RankCoords, scatter_batch, to_bytes  # noqa: E402
from megatron_bapo.rollout.batch import build_batch  # noqa: E402


def recipe_batch(num: int, min_len: int, max_len: int, prompt_len: int, seed: int) -> dict:
    """What the driver hands the trainer: `build_batch` rows (prompt + response), advantages, temperature."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    lengths[0] = max_len  # the length limit is hit in a real RL batch
    samples = []
    for n in lengths:
        r = max(n - prompt_len, 1)
        samples.append(SimpleNamespace(prompt_ids=[7] * (n - r), response_ids=torch.randint(1, 150_000, (r,)).tolist(),
                                       response_logprobs=[-1.5] * r, response_versions=[3] * r))
    batch = build_batch(samples, advantages=torch.randn(num, generator=g).tolist(),
                        rewards=torch.rand(num, generator=g).tolist())
    batch["temperature"] = 0.6
    return batch


def layout_coords(tp: int, pp: int, cp: int, dp: int) -> list[RankCoords]:
    """Every rank's coordinates (megatron's order does not matter here: only how many share each)."""
    return [RankCoords(dp_rank=d, cp_rank=c, first_stage=p == 0, last_stage=p == pp - 1)
            for p in range(pp) for d in range(dp) for c in range(cp) for _ in range(tp)]


def computed(args) -> None:
    batch = recipe_batch(args.seqs, args.min_len, args.max_len, args.prompt_len, seed=0)
    spec = BatchSpec(packed=True, cp_size=args.cp, sp_size=args.tp, dp_size=args.dp,
                     max_tokens_per_microbatch=args.budget, n_minibatches=args.n_minibatches, ppo_epochs=1,
                     loss_agg="token-mean")
    coords = layout_coords(args.tp, args.pp, args.cp, args.dp)
    world = len(coords)
    t0 = time.perf_counter()
    whole = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    t_pickle = time.perf_counter() - t0
    t0 = time.perf_counter()
    prepared = PreparedBatch(batch, spec)
    sizes = {c: to_bytes(prepared.for_rank(c)).numel() for c in set(coords)}
    t_cut = time.perf_counter() - t0
    received = [sizes[c] for c in coords[1:]]  # rank 0 keeps its own slice
    real = int(batch["attention_mask"].sum())
    scale = 1024 / args.seqs
    gb = 1e9
    print(f"batch: {args.seqs} rows x {batch['input_ids'].shape[1]} tokens (padded), {real / 1e6:.2f} M real tokens; "
          f"layout tp={args.tp} pp={args.pp} cp={args.cp} dp={args.dp} = {world} ranks")
    print(f"{'':34}{'per rank (max)':>16}{'per rank (mean)':>17}{'rank 0 sends':>14}  x1024/{args.seqs} rows")
    print(f"{'broadcast of the whole batch':34}{whole / gb:>14.3f} GB{whole / gb:>15.3f} GB{whole * (world - 1) / gb:>11.2f} GB"
          f"  {whole * (world - 1) * scale / gb:.1f} GB")
    print(f"{'own slice (scatter_batch)':34}{max(received) / gb:>14.3f} GB{statistics.mean(received) / gb:>15.3f} GB"
          f"{sum(received) / gb:>11.2f} GB  {sum(received) * scale / gb:.1f} GB")
    print(f"ratio (broadcast / slices): per rank {whole / statistics.mean(received):.1f}x (mean), "
          f"rank 0's sends {whole * (world - 1) / sum(received):.1f}x; bytes per real token on the wire: "
          f"{sum(received) / real:.1f} (broadcast: {whole * (world - 1) / real:.1f})")
    print(f"rank 0 CPU: pickle whole batch {t_pickle:.2f} s; prepare + cut + serialise {len(sizes)} distinct slices "
          f"{t_cut:.2f} s")


def _measure(rank, world_size, batch_args, mode, repeats):
    import torch.distributed as dist

    seqs, length, prompt_len = batch_args
    batch = recipe_batch(seqs, length // 8, length, prompt_len, seed=1) if rank == 0 else None
    spec = BatchSpec(packed=True, cp_size=2, sp_size=1, dp_size=world_size // 2, max_tokens_per_microbatch=length,
                     n_minibatches=1, ppo_epochs=1, loss_agg="token-mean")
    coords = RankCoords(dp_rank=rank // 2, cp_rank=rank % 2, first_stage=True, last_stage=True)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "broadcast":  # then every rank cuts its own slice, as Actor.train_step(batch) did
            box = [batch]
            dist.broadcast_object_list(box, src=0)
            PreparedBatch(box[0], spec).for_rank(coords)
        else:
            scatter_batch(batch, spec, coords, dist.group.WORLD)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measured(args) -> None:
    from dist_harness import run_dist

    batch_args = (args.measure_seqs, args.measure_len, min(args.prompt_len, args.measure_len // 16))
    print(f"\nmeasured: {args.measure_ranks} gloo ranks (DP {args.measure_ranks // 2} x CP 2) on loopback, "
          f"{args.measure_seqs} rows up to {args.measure_len} tokens, median of {args.repeats}")
    for mode in ("broadcast", "scatter"):
        t = run_dist(_measure, args.measure_ranks, batch_args, mode, args.repeats, timeout=900)[0]
        label = "broadcast whole batch + cut own" if mode == "broadcast" else "scatter_batch (own slice)"
        print(f"  {label:38} {t * 1000:8.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=67584)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--budget", type=int, default=67584, help="max tokens per micro-batch")
    ap.add_argument("--n-minibatches", type=int, default=4)
    ap.add_argument("--measure-ranks", type=int, default=4, help="0 skips the measured part")
    ap.add_argument("--measure-seqs", type=int, default=32)
    ap.add_argument("--measure-len", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on rank 0 (1: stable on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    computed(args)
    if args.measure_ranks:
        measured(args)


if __name__ == "__main__":
    main()
