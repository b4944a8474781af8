"""What the 32B recipe's rollout costs per step, measured on the real control plane at its proportions.

The recipe (examples/configs/qwen2.5-32b-bapo-64k.yaml): 64 prompts x 16 samples per step, 64k
responses in 16k segments (a response takes 4 rounds), rollout one step ahead, a weight sync (version
+1) after every step, `rollout.max_staleness` 4. The workload here has those proportions: the real
`RolloutClient`, `PartialRolloutManager`, `DynamicSampler` and `RolloutProducer` drive real built-in
servers over loopback; a segment is 4 tokens (`ignore_eos`: every response is 4 segments long) and
its time is modelled by the servers' `--decode-delay-ms` (1 s per generation step: a round lasts
about 4 s however many requests it holds, as a 64k round lasts as long as its longest 16k segment);
the trainer's step is modelled as `--train-s` (4 s, one round: the recipe sizes the actor so) of
waiting (the actor is not run: its time does not depend on the rollout mode). 30% of the groups
have equal rewards (seeded per prompt, as the recipe's data might give), the rest reward half of
their samples.

For `off`, `filter` and `refill` it prints, over the steps after warm-up (the pipeline filling):
rollout rounds per step, groups advanced per round (unfinished groups a round sends a segment to),
groups trained per step, the trainer's idle time per step (waiting for its round) and the tokens
regenerated (samples reset by the staleness cap). At 64k one round is one 16k-token segment of
every sample in flight: minutes; the rounds-per-step column is the multiplier on that.

Then the checkpoint's rollout state (the partial-rollout buffer, the rounds ready, the sampler's
step): one save and one resume through a real pipe to a forked driver process and on disk, at
`--checkpoint-samples` responses of 16k tokens (`benchmarks/bench_rollout_state.measure`, which also
fits the per-value cost over several sizes and extrapolates to the recipe's ~3x10^8 values: the
recipe's buffer does not fit these CPUs' memory as Python objects). `--checkpoint-samples 0` skips it.

    python benchmarks/bench_scale.py [--steps 16] [--warmup 4] [--decode-delay-ms 1000] [--train-s 4]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient,  # noqa: E402
                                   RolloutClientConfig, SamplingConfig)
from megatron_bapo.rollout import dynamic_sampling as ds  # noqa: E402
from megatron_bapo.rollout.producer import RolloutProducer  # noqa: E402
from megatron_bapo.server.launch import start_server  # noqa: E402
from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint  # noqa: E402


class _Workload:
    """Prompts, scripted rewards (a seeded 30% of the prompts with equal rewards) and the counters."""

    def __init__(self, zero_share: float, seed: int) -> None:
        self.zero_share, self.rng, self.next_index = zero_share, random.Random(seed), 0
        self.uniform: dict[int, bool] = {}

    def draw(self, n: int) -> list[Prompt]:
        out = [Prompt(prompt_ids=[5 + (self.next_index + i) % 50] + [7] * 7, index=self.next_index + i) for i in range(n)]
        self.next_index += n
        return out

    def score(self, groups: list) -> None:
        for g in groups:
            equal = self.uniform.setdefault(g.prompt.index, self.rng.random() < self.zero_share)
            for j, s in enumerate(g.samples):
                s.reward = 0.0 if equal else float(j % 2)


def run_mode(mode: str, urls: list[str], model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    cfg = PartialRolloutConfig(group_size=args.group_size, max_response_tokens=4 * args.segment_tokens,
                               segment_tokens=args.segment_tokens, max_staleness=args.max_staleness,
                               sampling=SamplingConfig(ignore_eos=True))
    work = _Workload(args.zero_share, seed=args.seed)
    rounds, advanced = [0], []
    served = [0]
    with RolloutClient(RolloutClientConfig(urls=urls, max_concurrency=args.concurrency)) as client:
        client.update_weights_from_disk(str(model_dir), 0)
        manager = PartialRolloutManager(client, cfg)
        astep = manager.astep

        async def counted(prompts, version, **kw):
            rounds[0] += 1
            advanced.append(len(prompts) + sum(1 for g in manager.buffer if not g.finished and not g.failed))
            return await astep(prompts, version, **kw)
        manager.astep = counted
        new = {"in_flight": ds.in_flight_of(manager), "headroom": args.headroom} if hasattr(ds, "in_flight_of") else {}
        sampler = ds.DynamicSampler(mode=mode, prompts_per_step=args.prompts, max_refill_rounds=8, draw=work.draw,
                                    advance=ds.manager_round(manager), requeue=ds.requeue_into(manager),
                                    score=work.score, **new)  # b74de61's sampler: neither
        producer = RolloutProducer(client, manager, sampler.produce, ahead=1, served_version=lambda: served[0],
                                   interrupt=sampler.interrupt)
        producer.start()
        per_step = []
        for step in range(1, args.warmup + args.steps + 1):
            r0, a0, regen0 = rounds[0], len(advanced), manager.totals["num_regenerated_tokens"]
            started = time.monotonic()
            done, waited = producer.next()
            logging.info("%s step %d: %d groups, waited %.2f s", mode, step, len(done.groups), time.monotonic() - started)
            time.sleep(args.train_s)  # the actor's step (modelled)
            served[0] = step  # the weight sync after the step
            client.update_weights_from_disk(str(model_dir), step)
            if step > args.warmup:
                per_step.append({"rounds": rounds[0] - r0, "idle": waited, "groups": len(done.groups),
                                 "regen": manager.totals["num_regenerated_tokens"] - regen0,
                                 "advanced": advanced[a0:]})
        producer.pause(abort=True)
        producer.stop()
    adv = [a for s in per_step for a in s["advanced"]]
    return {"rounds_per_step": statistics.mean(s["rounds"] for s in per_step),
            "groups_per_round": statistics.mean(adv) if adv else 0.0,
            "trained_per_step": statistics.mean(s["groups"] for s in per_step),
            "idle_s": statistics.mean(s["idle"] for s in per_step),
            "regen_tokens": sum(s["regen"] for s in per_step)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--segment-tokens", type=int, default=4)
    p.add_argument("--zero-share", type=float, default=0.3)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--headroom", type=float, default=0.1, help="rollout.refill_headroom")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--decode-delay-ms", type=float, default=1000.0,
                   help="the servers' time per decode step: 4 steps make a round last ~4 s, the stand-in for "
                        "one 16k-token segment (minutes at 32B), whatever the number of requests")
    p.add_argument("--train-s", type=float, default=4.0,
                   help="the actor's step, modelled as one round's time (the recipe's balance)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=["off", "filter", "refill"])
    p.add_argument("--checkpoint-samples", type=int, default=256,
                   help="responses of 16k tokens in the checkpoint measured through the driver process's pipe")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_checkpoint(Path(tmp) / "model", seed=0)
        extra = ["--decode-delay-ms", str(args.decode_delay_ms), "--max-running-requests", str(args.concurrency)]
        servers = [start_server(model_dir, extra_args=extra, log_path=Path(tmp) / f"server{i}.log")
                   for i in range(args.servers)]
        try:
            results = {m: run_mode(m, [s.url for s in servers], model_dir, args) for m in args.modes}
        finally:
            for s in servers:
                s.stop()
    print(f"{args.prompts} prompts x {args.group_size}, responses of 4 segments ({args.segment_tokens} tokens, "
          f"{args.decode_delay_ms:g} ms per decode step), {args.zero_share:.0%} equal-reward groups, rollout 1 step "
          f"ahead, a sync per step, train step {args.train_s:g} s; {args.steps} steps after {args.warmup} of warm-up")
    print("| mode | rollout rounds / step | groups advanced / round | groups trained / step | trainer idle / step "
          "(s, here) | trainer idle / step at 64k (estimate) | tokens regenerated |")
    print("|---|---|---|---|---|---|---|")
    for m, r in results.items():
        print(f"| {m} | {r['rounds_per_step']:.2f} | {r['groups_per_round']:.0f} | {r['trained_per_step']:.1f} | "
              f"{r['idle_s']:.2f} | {max(r['rounds_per_step'] - 1, 0):.2f} x one 16k segment | {r['regen_tokens']} |")
    print("(at 64k the recipe sizes the actor so that a step trains in about one round's time; rollout one step "
          "ahead then hides one round per step and the trainer waits for the others)")
    if args.checkpoint_samples:
        from bench_rollout_state import RECIPE_VALUES, measure

        r = measure(args.checkpoint_samples, 16384)
        scale = RECIPE_VALUES / r["values"]
        print(f"checkpoint rollout state ({r['format']}), {args.checkpoint_samples} x 16k-token responses = "
              f"{r['values']:.3g} values, MEASURED: save {r['save_s']:.2f} s, resume {r['resume_s']:.2f} s on rank 0's "
              f"critical path; {r['save_pipe_bytes'] / 2**20:.1f} MiB through the pipe on save, "
              f"{r['resume_pipe_bytes'] / 2**20:.1f} MiB on resume, {r['disk_bytes'] / 2**20:.1f} MiB on disk. "
              f"At the recipe's {RECIPE_VALUES:.0e} values, LINEAR EXTRAPOLATION (x{scale:.0f}): save ~{r['save_s'] * scale:.0f} s, "
              f"resume ~{r['resume_s'] * scale:.0f} s, pipe ~{r['save_pipe_bytes'] * scale / 2**30:.1f} GiB "
              f"(benchmarks/bench_rollout_state.py fits the per-value cost over several sizes)")


if __name__ == "__main__":
    main()
