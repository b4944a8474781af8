"""The rollout control plane, before and after, on the probe workload of the 32B issue, in one run.

The probe: the tiny task (`tools/make_tiny.py`), responses up to 96 tokens in 8-token segments,
rollout one step ahead (`trainer.async_steps=1`), every weight sync an "abort" pause
(`sync.pause_mode=abort`), `rollout.max_staleness=12` (the lowest value the code before accepts).
The same workload runs twice on this machine: with the code of `--before` (default 1b21a04, the
revision the issue read; checked out with `git archive` into a temporary directory) and with this
working tree. Both trainers talk to built-in servers started here from this working tree, with
`--decode-delay-ms` (default 4 ms per generation step, so that a sync meets segments in flight as it
does at 64k, where decoding a segment takes longer than a training step).

Per run it prints:
- idle per sync: seconds the trainer waited for its next round after a step that synced weights
  (`timing/rollout_wait_s`: the training GPUs' idle time a sync costs), mean and max;
- rounds to finish: for the groups whose longest response has the full 96 tokens, steps from the one
  that drew the prompt to the one that trained it (median, 90th percentile, max), and the same in
  wall seconds (the steps' own durations summed);
- regenerated share: tokens thrown away by regeneration over tokens generated (counted where a
  sample is reset, `Sample.reset`, so both revisions are measured the same way);
- updated-step share: steps with an optimizer update after warm-up (the first 13 steps: 12
  segments + 1 step ahead); the groups trained (with a full-length response, and in all) per minute
  of the run.

The counting hooks (a wrapper around `SampleLedger.record` and `Sample.reset`) observe; they change
nothing the trainer does.

    python benchmarks/bench_control_plane.py [--steps 60] [--decode-delay-ms 4] [--before 1b21a04]
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

ROOT = Path(__file__).resolve().parents[1]
PROBE = ["rollout.max_response_tokens=96", "rollout.segment_tokens=8", "trainer.async_steps=1",
         "sync.pause_mode=abort", "rollout.max_staleness=12"]
WARMUP = 13

# Runs `python -m megatron_bapo.train` with two observing hooks (argv: hooks file, then the CLI's).
LAUNCHER = r'''
import json, runpy, sys
from megatron_bapo import driver
from megatron_bapo.rollout import types

out = sys.argv.pop(1)
counts = {"regenerated_tokens": 0}
reset = types.Sample.reset

def counting_reset(self):
    counts["regenerated_tokens"] += len(self.response_ids)
    reset(self)

types.Sample.reset = counting_reset
record = driver.SampleLedger.record

def recording(self, step, prompts, groups):
    with open(out, "a") as f:
        f.write(json.dumps({"step": step, "drawn": [p.index for p in prompts], "regenerated_tokens":
                            counts["regenerated_tokens"], "groups": [
            {"prompt": g.prompt.index, "longest": max(len(s.response_ids) for s in g.samples)} for g in groups]}) + "\n")
    return record(self, step, prompts, groups)

driver.SampleLedger.record = recording
sys.argv[0] = "megatron_bapo.train"
runpy.run_module("megatron_bapo.train", run_name="__main__")
'''


def tiny_assets(path: Path) -> Path:
    if not (path / "info.json").exists():
        print(f"building the tiny task in {path} (tools/make_tiny.py) ...", flush=True)
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny.py"), "--out", str(path), "--force"],
                       check=True, stdout=subprocess.DEVNULL)
    return path


def checkout(rev: str, where: Path) -> Path:
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def run(tree: Path, assets: Path, out: Path, args) -> dict:
    """One training run of the probe with the code in `tree`, against a fresh server of this tree."""
    sys.path.insert(0, str(ROOT))
    from megatron_bapo.server.launch import start_server

    hooks = out.parent / f"{out.name}_groups.jsonl"
    launcher = out.parent / "launcher.py"
    launcher.write_text(LAUNCHER)
    server_args = ["--enable-deterministic-inference", "--weight-version", "0", "--decode-delay-ms",
                   str(args.decode_delay_ms), "--random-seed", "1"]
    with start_server(assets / "base_model", extra_args=server_args, log_path=out.parent / f"{out.name}_server.log",
                      env={**os.environ, "PYTHONPATH": str(ROOT)}) as server:
        cmd = [sys.executable, str(launcher), str(hooks), "--config", str(ROOT / "examples/configs/tiny_bapo.yaml"),
               "--no-resume", f"model.hf_path={assets / 'base_model'}", f"data.path={assets / 'data/train.jsonl'}",
               f"trainer.output_dir={out}", f"trainer.total_steps={args.steps}", "trainer.save_every=0",
               "trainer.progress=false", "trainer.max_steps_without_update=0", "eval.every_n_steps=0",
               "trainer.eval_at_start=false", f"rollout.client.urls=[\"{server.url}\"]", *PROBE]
        proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"training with {tree} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(ln) for ln in (out / "tb" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if "timing/step_s" in r]
    ledger = [json.loads(ln) for ln in hooks.read_text().splitlines() if ln.strip()]
    return summarize(steps, ledger)


def summarize(steps: list[dict], ledger: list[dict]) -> dict:
    drawn_at = {i: rec["step"] for rec in ledger for i in rec["drawn"]}
    full = [rec["step"] - drawn_at[g["prompt"]] + 1 for rec in ledger for g in rec["groups"] if g["longest"] >= 96]
    ends = {s["step"]: sum(r["timing/step_s"] for r in steps if r["step"] <= s["step"]) for s in steps}
    full_s = [ends[rec["step"]] - ends.get(drawn_at[g["prompt"]] - 1, 0.0)
              for rec in ledger for g in rec["groups"] if g["longest"] >= 96]
    minutes = sum(s["timing/step_s"] for s in steps) / 60
    after_sync = [s["timing/rollout_wait_s"] for prev, s in zip(steps, steps[1:]) if prev.get("train/updated")]
    generated = sum(s.get("rollout/num_tokens_generated", 0.0) for s in steps)
    regenerated = ledger[-1]["regenerated_tokens"] if ledger else 0
    late = steps[WARMUP:]
    q = statistics.quantiles(full, n=10) if len(full) >= 2 else [float("nan")] * 9
    return {
        "idle_mean": statistics.mean(after_sync) if after_sync else float("nan"),
        "idle_max": max(after_sync, default=float("nan")),
        "sync_s": statistics.mean(s.get("timing/sync_s", 0.0) for s in steps if s.get("train/updated")),
        "rounds_median": statistics.median(full) if full else float("nan"), "rounds_p90": q[8],
        "rounds_max": max(full, default=float("nan")), "num_full": len(full),
        "seconds_median": statistics.median(full_s) if full_s else float("nan"),
        "full_per_min": len(full) / minutes, "groups_per_min": sum(len(rec["groups"]) for rec in ledger) / minutes,
        "regenerated": regenerated / generated if generated else float("nan"),
        "updated": sum(s["train/updated"] for s in late) / len(late) if late else float("nan"),
        "num_late": len(late), "step_s": statistics.median(s["timing/step_s"] for s in steps[1:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--decode-delay-ms", type=float, default=4.0)
    p.add_argument("--before", default="1b21a04", help="the revision to compare with (git rev)")
    p.add_argument("--assets", default=str(ROOT / "runs" / "tiny_assets"))
    args = p.parse_args()
    assets = tiny_assets(Path(args.assets))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = checkout(args.before, Path(tmp) / "before")
        for label, tree in ((f"before ({args.before})", before), ("after (this tree)", ROOT)):
            results[label] = run(tree, assets, Path(tmp) / label.split()[0], args)
    print(f"\n[control plane] tiny task, {args.steps} steps, {' '.join(PROBE)}, server --decode-delay-ms "
          f"{args.decode_delay_ms}")
    rows = [("idle per sync, mean s (trainer waiting for its round after a sync)", "idle_mean", "{:.3f}"),
            ("idle per sync, max s", "idle_max", "{:.3f}"),
            ("weight sync, mean s", "sync_s", "{:.3f}"),
            ("rounds to finish a 96-token response, median", "rounds_median", "{:.1f}"),
            ("rounds to finish a 96-token response, p90", "rounds_p90", "{:.1f}"),
            ("rounds to finish a 96-token response, max", "rounds_max", "{:.0f}"),
            ("seconds to finish a 96-token response, median (wall, steps summed)", "seconds_median", "{:.1f}"),
            ("groups with a 96-token response trained per minute", "full_per_min", "{:.1f}"),
            ("groups trained per minute", "groups_per_min", "{:.1f}"),
            ("regenerated share of generated tokens", "regenerated", "{:.1%}"),
            (f"updated-step share after warm-up (steps {WARMUP + 1}-{args.steps})", "updated", "{:.1%}"),
            ("median s/step", "step_s", "{:.3f}")]
    labels = list(results)
    print(f"{'':70}" + "".join(f"{lab:>22}" for lab in labels))
    for name, key, fmt in rows:
        print(f"{name:70}" + "".join(f"{fmt.format(results[lab][key]):>22}" for lab in labels))


if __name__ == "__main__":
    main()
