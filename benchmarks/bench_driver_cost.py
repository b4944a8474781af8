"""What the rollout driver costs rank 0's step, in the 8-rank rehearsal of the 32B recipe's knobs.

Rank 0 runs the driver next to its share of training: the rollout client's thread (HTTP, reply
parsing, the partial-rollout buffer) runs concurrently with training when rollout runs ahead, and
the driver's own work (rewards, advantages, the batch, the ledger) runs before the batch goes out,
while every other rank waits for it at the scatter. Both are on every rank's critical path.

The rehearsal is `tests/test_recipe.py`'s: a tiny model with TP 2 + SP, PP 2, CP 2 (8 ranks),
full recompute, the distributed optimizer, packing, partial rollout, the distributed gloo weight
sync; here with rollout one step ahead (`trainer.async_steps=1`, `sync.pause_mode=abort`), a built-in
server slowed to `--decode-delay-ms` per generation step (so its own CPU use stays small, as on a
separate node), and, for comparison, the same with `async_steps=0` (nothing runs next to training).

Three modes: the driver inside rank 0's process with rollout one step ahead (`async_steps=1`), the
same with the driver in its own process (`trainer.driver_process=true`, the recipes' setting), and
the inline driver with nothing next to training (`async_steps=0`). Per mode it prints the median
per step (steps 2..N) of: the step, the training phase (`timing/train_s`), the rollout wait, the
driver's critical-path work (`timing/driver_s`, plus `timing/batch_prepare_s` when the driver process
also cuts the slices; every rank waits for it, wherever it runs), its rollout thread's CPU next to
training (`timing/driver_thread_cpu_s`; in the driver process, not rank 0's, when it runs there),
and what the driver costs rank 0's own process: inline, the critical-path work plus the thread's CPU;
in its own process, `timing/driver_rank0_s` (the pipe, pickling, the shipment and weight buckets
handed over), with its share of the step.

    python benchmarks/bench_driver_cost.py [--steps 8] [--decode-delay-ms 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
REWARD = "def parity_reward(response: str, answer: str) -> float:\n    return float(len(response) % 2 == 0)\n"
KEYS = ("timing/step_s", "timing/train_s", "timing/rollout_wait_s", "timing/driver_s", "timing/driver_thread_cpu_s")
MODES = {"inline, async 1": (1, False), "process, async 1": (1, True), "inline, async 0": (0, False)}


def run(root: Path, model: Path, name: str, async_steps: int, driver_process: bool, args) -> list[dict]:
    out = root / name
    cfg = {
        "bapo_preset": "bapo",
        "model": {"hf_path": str(model)},
        "data": {"path": str(root / "train.jsonl"), "apply_chat_template": False, "max_prompt_tokens": 32},
        "trainer": {"output_dir": str(out), "total_steps": args.steps, "save_every": 0, "progress": False, "seed": 3,
                    "async_steps": async_steps, "eval_at_start": False, "driver_process": driver_process},
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_response_tokens": 8, "segment_tokens": 4,
                    "max_staleness": 2, "deterministic_inference": True, "sampling": {"temperature": 0.6},
                    "builtin_server_decode_delay_ms": args.decode_delay_ms, "client": {"health_timeout_s": 180}},
        "reward": {"fn": "bench_reward:parity_reward", "num_workers": 0},
        "actor": {"optim": {"lr": 1e-3}, "n_minibatches": 1, "max_tokens_per_microbatch": 96, "vocab_divisible_by": 64,
                  "recompute": "full", "use_distributed_optimizer": True, "packing": True,
                  "parallel": {"tp": 2, "sequence_parallel": True, "pp": 2, "cp": 2}},
        "sync": {"method": "distributed", "backend": "gloo", "pause_mode": "abort"},
        "eval": {"every_n_steps": 0},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(root)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8", "-m",
           "megatron_bapo.train", "--config", str(path), "--no-resume"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(x) for x in (out / "tb" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "timing/step_s" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--decode-delay-ms", type=float, default=5.0)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]} for a in range(10, 60) for b in range(10, 14)]
        (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / "bench_reward.py").write_text(REWARD)
        model = make_tiny_hf_checkpoint(root / "model", seed=0)
        results = {mode: run(root, model, f"mode{i}", *MODES[mode], args) for i, mode in enumerate(MODES)}
    print(f"\n[driver cost] 8-rank rehearsal (TP 2 + SP, PP 2, CP 2, distributed gloo sync), {args.steps} steps, "
          f"server --decode-delay-ms {args.decode_delay_ms}; medians over steps 2-{args.steps}")
    cols = ("s/step", "train", "rollout wait", "driver (crit. path)", "thread CPU", "on rank 0", "share of step")
    print(f"{'':18}" + "".join(f"{c:>20}" for c in cols))
    for mode, steps in results.items():
        later = steps[1:]

        def med(f) -> float:
            return statistics.median(f(r) for r in later)

        critical = med(lambda r: r["timing/driver_s"] + r.get("timing/batch_prepare_s", 0.0))
        if MODES[mode][1]:  # its own process: rank 0 only relays
            rank0 = med(lambda r: r["timing/driver_rank0_s"])
            share = med(lambda r: r["timing/driver_rank0_s"] / r["timing/step_s"])
        else:
            rank0 = med(lambda r: r["timing/driver_s"] + r["timing/driver_thread_cpu_s"])
            share = med(lambda r: (r["timing/driver_s"] + r["timing/driver_thread_cpu_s"]) / r["timing/step_s"])
        vals = (med(lambda r: r["timing/step_s"]), med(lambda r: r["timing/train_s"]),
                med(lambda r: r["timing/rollout_wait_s"]), critical, med(lambda r: r["timing/driver_thread_cpu_s"]), rank0)
        print(f"{mode:18}" + "".join(f"{v:>20.3f}" for v in vals) + f"{share:>20.1%}")


if __name__ == "__main__":
    main()
