"""Print how a run went: reward and held-out accuracy at the start vs the end.

    python tools/summarize_run.py runs/tiny_bapo

Reads `<run>/tb/metrics.jsonl` (written by the trainer next to the TensorBoard events).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_bapo.metrics import read_jsonl_metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(run_dir: Path, window: int = 3) -> list[str]:
    records = read_jsonl_metrics(run_dir / "tb")
    if not records:
        raise SystemExit(f"{run_dir}/tb/metrics.jsonl has no records; did the run start?")
    lines = [f"run: {run_dir} ({max(r['step'] for r in records)} steps)"]
    train = [r for r in records if "rollout/reward_mean" in r]
    for key, label in (("rollout/reward_mean", "train reward"), ("rollout/accuracy", "train accuracy")):
        vals = [float(r[key]) for r in train if key in r]
        if vals:
            lines.append(f"{label:<16} first {min(window, len(vals))} steps {_mean(vals[:window]):.3f}  "
                         f"last {min(window, len(vals))} steps {_mean(vals[-window:]):.3f}")
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and "/avg@" in k})
    for key in eval_keys:
        points = [(r["step"], float(r[key])) for r in records if key in r]
        lines.append(f"{key:<16} " + "  ".join(f"step {s}: {v:.3f}" for s, v in points))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    print("\n".join(summarize(args.run_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
