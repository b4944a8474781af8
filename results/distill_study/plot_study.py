"""Table and plot of the distillation study (examples/tiny_distill_study.sh): steps and wall time to the teacher's eval.

    python results/distill_study/plot_study.py --out results/distill_study \
        --teacher-eval runs/distill_study/teacher_eval_n4/metrics.json \
        --teacher-eval-ref runs/distill_study/teacher_eval_n32/metrics.json \
        --runs distill=runs/distill_study/distill/seed1,... rl=runs/distill_study/rl/seed1,...
    python results/distill_study/plot_study.py --out results/distill_study --from-csv   # replot from the CSVs

Reads each run's `tb/metrics.jsonl` and the teacher's `tools/evaluate.py` metrics.json (avg@n). Writes
`curves.csv` (one row per arm, seed and eval step: avg@4, the eval's truncated share, and the run's
training wall time to that step), `runs.csv` (one row per run: what the table's "why" columns read),
`teacher_eval.json`, `table.md` and `eval_vs_step.png` (avg@4 against step and against training
minutes; thin lines per seed, thick the seed mean; solid the target, dashed the n=32 reference).

"Training wall time to step k" is the sum of the run's `timing/step_s` over steps 1..k less its
`timing/eval_s` (both arms run the same evals; they measure, they do not train); "run, start to end" is
the run's closing line in `logs/train.log` (setup, servers, the step-0 eval and teardown included).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_bapo.metrics import read_jsonl_metrics  # noqa: E402

GRID_HIGH_MAX = 3.0
"""BAPO's default `high_max` (the `bapo` preset): a c_high there means the search ran out of grid."""


def _avg_key(metrics: dict) -> str:
    return next(k for k in sorted(metrics) if k.startswith("eval/") and "/avg@" in k)


def teacher_value(path: Path) -> float:
    """The avg@n of a `tools/evaluate.py` metrics.json (its one dataset)."""
    metrics = json.loads(path.read_text(encoding="utf-8"))["metrics"]
    return float(metrics[_avg_key(metrics)])


def _mean(records: list[dict], key: str, lo: int = 1, hi: int = 10**9) -> Optional[float]:
    values = [float(r[key]) for r in records if lo <= r["step"] <= hi and isinstance(r.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def read_run(arm: str, run_dir: Path, index: int) -> tuple[list[dict], dict]:
    """(eval rows, run summary) of one run directory."""
    records = read_jsonl_metrics(run_dir / "tb")
    if not records:
        raise SystemExit(f"run {run_dir}: no metrics in {run_dir / 'tb' / 'metrics.jsonl'}")
    found = re.search(r"seed(\d+)", run_dir.name)
    seed = int(found.group(1)) if found else index + 1
    key = _avg_key({k: 1 for r in records for k in r})
    trunc_key = key.rsplit("/", 1)[0] + "/truncated_frac"
    wall, rows = 0.0, []
    for r in records:
        wall += float(r.get("timing/step_s", 0.0)) - float(r.get("timing/eval_s", 0.0))
        if key in r:
            rows.append({"arm": arm, "seed": seed, "step": r["step"], "eval_avg": float(r[key]),
                         "eval_truncated_frac": float(r.get(trunc_key, float("nan"))), "train_wall_s": round(wall, 2)})
    last = records[-1]["step"]
    log = run_dir / "logs" / "train.log"
    done = re.findall(r"done: steps \d+-\d+ in (\d+) s", log.read_text(encoding="utf-8")) if log.exists() else []
    updated = [r for r in records if r.get("train/updated") and "bapo/c_high" in r]
    summary = {
        "arm": arm, "seed": seed, "steps": last,
        "steps_wall_s": round(sum(float(r.get("timing/step_s", 0.0)) for r in records), 1),
        "run_wall_s": float(done[-1]) if done else None,
        "train_wall_s": round(wall, 1),
        "reward_first10": _mean(records, "rollout/reward_mean", 1, 10),
        "reward_last10": _mean(records, "rollout/reward_mean", last - 9, last),
        "rho_before": _mean(records, "bapo/rho_before"), "rho_after": _mean(records, "bapo/rho_after"),
        "frac_steps_c_high_at_grid_end": (sum(float(r["bapo/c_high"]) >= GRID_HIGH_MAX - 1e-6 for r in updated)
                                          / len(updated)) if updated else None,
        "c_low": _mean(records, "bapo/c_low"), "c_high": _mean(records, "bapo/c_high"),
        "teacher_s_per_step": _mean(records, "timing/teacher_s"),
        "frac_positive_advantage": _mean(records, "distill/frac_positive_advantage"),
        "reverse_kl_first10": _mean(records, "distill/reverse_kl_mean", 1, 10),
        "reverse_kl_last10": _mean(records, "distill/reverse_kl_mean", last - 9, last),
        "clipfrac_neg": _mean(records, "actor/clipfrac_neg"), "clipfrac_pos": _mean(records, "actor/clipfrac_pos"),
        "truncated_first10": _mean(records, "rollout/frac_truncated", 1, 10),
        "truncated_last10": _mean(records, "rollout/frac_truncated", last - 9, last),
    }
    return rows, summary


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else ("" if v is None else v)) for k, v in row.items()})


def _read_csv(path: Path) -> list[dict]:
    def num(v: str):
        if v == "":
            return None
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v
    with path.open(encoding="utf-8") as f:
        return [{k: num(v) for k, v in row.items()} for row in csv.DictReader(f)]


def reach(rows: list[dict], target: float) -> tuple[Optional[int], Optional[float]]:
    """(first eval step with avg >= target, training wall seconds to it), or (None, None)."""
    for row in sorted(rows, key=lambda r: r["step"]):
        if row["eval_avg"] >= target:
            return row["step"], row["train_wall_s"]
    return None, None


def halfway(curves: list[dict], target: float) -> float:
    """Midpoint of the mean step-0 eval (the base, every run) and the target: a level both arms can reach."""
    base = [r["eval_avg"] for r in curves if r["step"] == 0]
    return (statistics.fmean(base) + target) / 2


def _fmt(v: Optional[float], spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def table(curves: list[dict], runs: list[dict], target: float, ref: Optional[float]) -> list[str]:
    half = halfway(curves, target)
    lines = [f"Target: the teacher's eval avg@4 = {target:.3f}" + (f" (n=32 reference {ref:.3f})" if ref else "")
             + f"; half-way: {half:.3f} (the mean step-0 eval and the target's midpoint)", "",
             "| arm | seed | eval step 0 | final eval (step 100) | best eval | steps to target | train wall to target (s) "
             + ("| steps to n=32 ref " if ref else "") + "| steps to half-way | train wall to half-way (s) "
             "| train wall 100 steps (s) | steps incl. evals (s) | run, start to end (s) |",
             "|---|---|---|---|---|---|---|" + ("---|" if ref else "") + "---|---|---|---|---|"]
    for run in runs:
        rows = [r for r in curves if r["arm"] == run["arm"] and r["seed"] == run["seed"]]
        by_step = {r["step"]: r["eval_avg"] for r in rows}
        step, wall = reach(rows, target)
        ref_step = reach(rows, ref)[0] if ref else None
        half_step, half_wall = reach(rows, half)
        reached = f"{step}" if step is not None else f"not reached in {run['steps']}"
        lines.append(f"| {run['arm']} | {run['seed']} | {by_step.get(0, float('nan')):.3f} | "
                     f"{by_step.get(max(by_step), float('nan')):.3f} | {max(by_step.values()):.3f} | {reached} | "
                     f"{_fmt(wall, '.0f')} | " + (f"{ref_step if ref_step is not None else 'not reached'} | " if ref else "")
                     + f"{half_step if half_step is not None else 'not reached'} | {_fmt(half_wall, '.0f')} | "
                     + f"{run['train_wall_s']:.0f} | {run['steps_wall_s']:.0f} | {_fmt(run['run_wall_s'], '.0f')} |")
    lines += ["", "Why (means over the run's steps; first / last 10 steps where two numbers):", "",
              "| arm | seed | reward (train) | BAPO rho before -> after | c_low / c_high | steps with c_high at 3.0 "
              "| positive-advantage tokens | reverse KL est. | clipped neg / pos | truncated (train) | teacher s/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        lines.append(
            f"| {run['arm']} | {run['seed']} | {_fmt(run['reward_first10'])} / {_fmt(run['reward_last10'])} | "
            f"{_fmt(run['rho_before'])} -> {_fmt(run['rho_after'])} | {_fmt(run['c_low'], '.2f')} / {_fmt(run['c_high'], '.2f')} | {_fmt(run['frac_steps_c_high_at_grid_end'], '.2f')} | "
            f"{_fmt(run['frac_positive_advantage'])} | {_fmt(run['reverse_kl_first10'])} / {_fmt(run['reverse_kl_last10'])} | "
            f"{_fmt(run['clipfrac_neg'])} / {_fmt(run['clipfrac_pos'])} | "
            f"{_fmt(run['truncated_first10'])} / {_fmt(run['truncated_last10'])} | {_fmt(run['teacher_s_per_step'], '.2f')} |")
    return lines


def plot(curves: list[dict], target: float, ref: Optional[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80, sharey=True)
    colors = {}
    for arm in dict.fromkeys(r["arm"] for r in curves):
        rows = [r for r in curves if r["arm"] == arm]
        seeds = sorted({r["seed"] for r in rows})
        for ax, x in zip(axes, ("step", "train_wall_s")):
            for seed in seeds:
                mine = sorted((r for r in rows if r["seed"] == seed), key=lambda r: r["step"])
                xs = [r[x] / (60.0 if x == "train_wall_s" else 1.0) for r in mine]
                (line,) = ax.plot(xs, [r["eval_avg"] for r in mine], linewidth=0.8, alpha=0.45, color=colors.get(arm))
                colors.setdefault(arm, line.get_color())
            steps = sorted({r["step"] for r in rows})
            mean_y = [statistics.fmean(r["eval_avg"] for r in rows if r["step"] == s) for s in steps]
            mean_x = [statistics.fmean(r[x] for r in rows if r["step"] == s) / (60.0 if x == "train_wall_s" else 1.0)
                      for s in steps]
            ax.plot(mean_x, mean_y, linewidth=2.0, color=colors[arm], label=f"{arm} (mean of {len(seeds)} seeds)")
    for ax, xlabel in zip(axes, ("step", "training wall time (min)")):
        ax.axhline(target, color="black", linewidth=1.0, label=f"teacher avg@4 {target:.3f}")
        if ref is not None:
            ax.axhline(ref, color="black", linewidth=0.8, linestyle="--", label=f"teacher avg@32 {ref:.3f}")
        ax.axhline(halfway(curves, target), color="gray", linewidth=0.8, linestyle=":", label="half-way")
        ax.set_xlabel(xlabel)
        ax.set_ylim(top=max([target, ref or 0.0] + [r["eval_avg"] for r in curves]) + 0.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval avg@4 (200 held-out problems, T=1)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("On-policy distillation vs RL from the reward (tiny task, 100 steps, seeds 1-3)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=[], help="arm=run_dir[,run_dir...] (one dir per seed)")
    parser.add_argument("--teacher-eval", type=Path, help="tools/evaluate.py metrics.json of the teacher (the target)")
    parser.add_argument("--teacher-eval-ref", type=Path, help="the same at a larger n (a reference line)")
    parser.add_argument("--from-csv", action="store_true", help="replot from OUT/{curves,runs}.csv, teacher_eval.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.from_csv:
        curves, runs = _read_csv(out / "curves.csv"), _read_csv(out / "runs.csv")
        teacher = json.loads((out / "teacher_eval.json").read_text(encoding="utf-8"))
    else:
        if not args.runs or args.teacher_eval is None:
            parser.error("--runs and --teacher-eval are required (or --from-csv)")
        curves, runs = [], []
        for item in args.runs:
            arm, _, paths = item.partition("=")
            if not paths:
                parser.error(f"--runs expects arm=run_dir[,run_dir...], got {item!r}")
            for i, p in enumerate(paths.split(",")):
                rows, summary = read_run(arm, Path(p), i)
                curves += rows
                runs.append(summary)
        teacher = {"target_avg@4": teacher_value(args.teacher_eval),
                   "reference_avg@32": teacher_value(args.teacher_eval_ref) if args.teacher_eval_ref else None}
        _write_csv(out / "curves.csv", curves)
        _write_csv(out / "runs.csv", runs)
        (out / "teacher_eval.json").write_text(json.dumps(teacher, indent=2) + "\n", encoding="utf-8")
    target, ref = teacher["target_avg@4"], teacher.get("reference_avg@32")
    lines = table(curves, runs, target, ref)
    (out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    plot(curves, target, ref, out / "eval_vs_step.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
