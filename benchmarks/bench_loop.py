"""Seconds per RL step, synchronous vs asynchronous (`trainer.async_steps`), measured and simulated.

Part 1 (`--part tiny`, measured): the tiny default loop on this machine, run through the CLI as a
user runs it, once with `trainer.async_steps=0` and once with 1, alternating for `--rounds`
rounds; prints the median s/step (the first step excluded: server start, first compiles) and the
breakdown from the run's own timing metrics (rollout, time the trainer waited for rollout, reward,
train, weight sync).

Part 2 (`--part sim`, a model, not a measurement): the disaggregated 32B layout of
`examples/run_32b_bapo.sh` (8 nodes of SGLang, TP 8 per engine; 8 nodes of actor) on the
response-length distribution of 64k RL, with partial rollout (16k segments). Decoding is simulated
engine by engine with continuous batching under a KV-cache budget; training is FLOP-counted.
Every constant is printed with where it comes from; change them with flags.

    python benchmarks/bench_loop.py [--part tiny|sim|both] [--steps 12 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BREAKDOWN = ("timing/step_s", "timing/rollout_s", "timing/rollout_wait_s", "timing/reward_s", "timing/train_s",
             "timing/sync_s")


# ---------------------------------------------------------------------- part 1: measured tiny loop
def tiny_assets(path: Path) -> Path:
    if not (path / "info.json").exists():
        print(f"building the tiny task in {path} (tools/make_tiny.py) ...", flush=True)
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny.py"), "--out", str(path), "--force"],
                       check=True, stdout=subprocess.DEVNULL)
    return path


def run_tiny(assets: Path, out: Path, async_steps: int, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_bapo.train", "--config", str(ROOT / "examples" / "configs" / "tiny_bapo.yaml"),
           "--no-resume", f"model.hf_path={assets / 'base_model'}", f"data.path={assets / 'data' / 'train.jsonl'}",
           f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.save_every=0", "trainer.progress=false",
           "eval.every_n_steps=0", f"trainer.async_steps={async_steps}",
           f"rollout.max_staleness={2 + async_steps}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"training failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in (out / "tb" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in rows if "timing/step_s" in r]


def part_tiny(args) -> None:
    assets = tiny_assets(Path(args.assets))
    per_mode: dict[int, list[dict]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for k in (0, 1):
                rows = run_tiny(assets, Path(tmp) / f"k{k}_{r}", k, args.steps)
                per_mode[k] += rows[1:]  # step 1: server start, first compiles
    print(f"\n[tiny loop] tools/make_tiny.py assets, examples/configs/tiny_bapo.yaml, {args.steps} steps x "
          f"{args.rounds} rounds per mode (first step of each run excluded); median seconds per step")
    print(f"{'':22}" + "".join(f"{k.split('/')[1]:>14}" for k in BREAKDOWN))
    med = {}
    for k, rows in per_mode.items():
        med[k] = {key: statistics.median([r.get(key, 0.0) for r in rows]) for key in BREAKDOWN}
        print(f"{'async_steps=' + str(k):22}" + "".join(f"{med[k][key]:>14.3f}" for key in BREAKDOWN))
    print(f"sync / async s/step: {med[0]['timing/step_s'] / med[1]['timing/step_s']:.2f}x "
          f"(async hides rollout behind training: it waits {med[1]['timing/rollout_wait_s']:.3f} s per step for rollout "
          f"vs {med[0]['timing/rollout_wait_s']:.3f} s synchronous)")


# ---------------------------------------------------------------------- part 2: simulated 32B layout
def response_lengths(n: int, median: float, sigma: float, cap: int, rng: random.Random) -> list[int]:
    return [min(cap, max(64, int(math.exp(math.log(median) + sigma * rng.gauss(0.0, 1.0))))) for _ in range(n)]


def rollout_seconds(jobs: list[tuple[int, int]], args) -> float:
    """Wall time for every engine to generate its jobs: (context so far, tokens to generate).

    Continuous batching per engine: sequences are admitted while their KV (context + budget) fits,
    all running ones advance one token per decode step, a step costs
    `weights_ms + kv_ms_per_token * (sum of running contexts)`.
    """
    engines = [jobs[i::args.engines] for i in range(args.engines)]
    worst = 0.0
    for queue in engines:
        queue = sorted(queue, key=lambda j: -j[1])  # longest first
        running: list[list[int]] = []
        t, used = 0.0, 0
        while queue or running:
            while queue and used + queue[0][0] + queue[0][1] <= args.kv_tokens:
                ctx, todo = queue.pop(0)
                running.append([ctx, todo])
                used += ctx + todo
                t += ctx * args.prefill_ms_per_token / 1000.0
            if not running:  # one sequence larger than the budget: run it alone
                ctx, todo = queue.pop(0)
                running.append([ctx, todo])
                used += ctx + todo
            chunk = min(min(r[1] for r in running), args.sim_chunk)
            ctx_sum = sum(r[0] for r in running) + len(running) * chunk / 2
            t += chunk * (args.weights_ms + args.kv_ms_per_token * ctx_sum) / 1000.0
            for r in running:
                r[0] += chunk
                r[1] -= chunk
            done = [r for r in running if r[1] == 0]
            running = [r for r in running if r[1] > 0]
            used -= sum(r[0] for r in done)
        worst = max(worst, t)
    return worst


def part_sim(args) -> None:
    rng = random.Random(0)
    n_params, layers, hidden = 32.76e9, 64, 5120
    train_gpus = args.train_nodes * 8
    flops_per_token_dense = (6 + 2 + 2) * n_params  # fwd+bwd, full-recompute forward, the bound-search forward
    # Steady state of partial rollout: each RL step advances every buffered sample by one segment.
    lengths = response_lengths(args.batch * 4, args.median_len, args.sigma, args.max_len, rng)
    segs = []  # (context so far, tokens this step) of the samples one RL step advances
    for n in lengths[: args.batch * 2]:
        done = rng.randrange(0, max(1, math.ceil(n / args.segment))) * args.segment
        segs.append((args.prompt_len + done, min(args.segment, n - done)))
    segs = [s for s in segs if s[1] > 0][: int(args.batch * 1.6)]
    rollout_s = rollout_seconds(segs, args)
    trained = lengths[: args.batch]
    tokens = sum(args.prompt_len + n for n in trained)
    attn = sum(12 * layers * hidden * (args.prompt_len + n) ** 2 / 2 for n in trained) * (10 / 6)
    train_s = (tokens * flops_per_token_dense + attn) / (train_gpus * args.peak_tflops * 1e12 * args.mfu)
    sync_s = 2 * n_params / (args.sync_gbps * 1e9 / 8)
    sync_step = rollout_s + train_s + sync_s
    async_step = max(rollout_s + args.pause_s, train_s + sync_s)
    print(f"\n[32B layout, simulated] {args.engines} SGLang engines (TP 8) vs {train_gpus} actor GPUs; batch "
          f"{args.batch} responses, lengths log-normal median {args.median_len} sigma {args.sigma} capped at {args.max_len} "
          f"(mean {statistics.mean(lengths):.0f}), {args.segment}-token segments")
    print(f"  constants: decode step {args.weights_ms} ms + {args.kv_ms_per_token:g} ms per resident context token "
          f"(bf16 KV of Qwen2.5-32B: 256 KiB/token, /TP 8 per GPU, at 3.35 TB/s); KV budget {args.kv_tokens} tokens per "
          f"engine (~60 GB free per GPU); prefill {args.prefill_ms_per_token} ms/token; training at {args.mfu:.0%} MFU of "
          f"{args.peak_tflops} TFLOP/s per H100 (bf16 dense), 10N FLOPs/token + attention; weight sync {args.sync_gbps} "
          f"Gbit/s of bf16; async pause {args.pause_s} s")
    print(f"  per RL step: rollout {rollout_s:.0f} s, train {train_s:.0f} s, sync {sync_s:.0f} s")
    for name, step in (("sync (async_steps=0)", sync_step), ("async (async_steps=1)", async_step)):
        print(f"  {name:22} {step:7.0f} s/step; rollout GPUs busy {rollout_s / step:4.0%}, actor GPUs busy "
              f"{(train_s + sync_s) / step:4.0%}")
    print(f"sync / async s/step: {sync_step / async_step:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("tiny", "sim", "both"), default="both")
    ap.add_argument("--steps", type=int, default=12, help="tiny: RL steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="tiny: runs per mode (alternating)")
    ap.add_argument("--assets", default=str(ROOT / "runs" / "tiny_assets"), help="tiny: task assets (built if missing)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--train-nodes", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--median-len", type=int, default=9000)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--max-len", type=int, default=65536)
    ap.add_argument("--segment", type=int, default=16384)
    ap.add_argument("--weights-ms", type=float, default=6.0, help="decode step floor: weights + TP all-reduces")
    ap.add_argument("--kv-ms-per-token", type=float, default=1e-5)
    ap.add_argument("--kv-tokens", type=int, default=1_800_000)
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.02)
    ap.add_argument("--sim-chunk", type=int, default=256)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--mfu", type=float, default=0.35)
    ap.add_argument("--sync-gbps", type=float, default=200.0)
    ap.add_argument("--pause-s", type=float, default=5.0)
    args = ap.parse_args()
    t0 = time.time()
    if args.part in ("sim", "both"):
        part_sim(args)
    if args.part in ("tiny", "both"):
        part_tiny(args)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
