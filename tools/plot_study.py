"""Summarise and plot a staleness study: several runs (one per clipping preset) side by side.

    python tools/plot_study.py --runs grpo=runs/study/grpo clip-higher=runs/study/clip-higher \
        bapo=runs/study/bapo --out results/staleness_study

Reads each run's `tb/metrics.jsonl` (written by the trainer), writes `table.md` (final and
best rewards, eval accuracy, entropy, clip bounds) and small PNGs (reward, entropy, c_low/c_high,
positive contribution) to `--out`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_bapo.metrics import read_jsonl_metrics  # noqa: E402

PLOTS = {
    "reward.png": ("Mean reward (train rollouts)", ["rollout/reward_mean"]),
    "eval_accuracy.png": ("Eval accuracy (held-out avg@n)", ["eval/*/avg@*"]),
    "entropy.png": ("Policy entropy (loss tokens)", ["actor/entropy"]),
    "clip_bounds.png": ("Clip bounds", ["bapo/c_low", "bapo/c_high"]),
    "positive_contribution.png": ("Positive contribution share after the search", ["bapo/rho_after"]),
}


def _resolve(records, tag):
    """`eval/*/avg@*` -> the first matching eval tag of the run (dataset names differ between runs)."""
    if "*" not in tag:
        return tag
    return next((k for r in records for k in sorted(r) if k.startswith("eval/") and "/avg@" in k), tag)


def _series(records, tag):
    tag = _resolve(records, tag)
    points = [(r["step"], r[tag]) for r in records if isinstance(r.get(tag), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _smooth(values, window=5):
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="name=run_dir pairs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for item in args.runs:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"--runs expects name=run_dir, got {item!r}")
        records = read_jsonl_metrics(Path(path) / "tb")
        if not records:
            parser.error(f"run {name!r}: no metrics in {Path(path) / 'tb' / 'metrics.jsonl'}")
        runs[name] = records
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    for filename, (title, tags) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
        drawn = False
        for name, records in runs.items():
            for tag in tags:
                steps, values = _series(records, tag)
                if not steps:
                    continue
                label = name if len(tags) == 1 else f"{name} {tag.split('/')[-1]}"
                smooth = _smooth(values) if "reward" in tag else values
                ax.plot(steps, smooth, label=label, linewidth=1.4)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / filename)
        plt.close(fig)

    lines = [
        "| run | steps | reward first 5 | reward last 5 | eval first | eval last | entropy last | c_low last | c_high last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, records in runs.items():
        _, reward = _series(records, "rollout/reward_mean")
        _, ent = _series(records, "actor/entropy")
        _, low = _series(records, "bapo/c_low")
        _, high = _series(records, "bapo/c_high")
        _, ev = _series(records, "eval/*/avg@*")

        def mean(xs):
            return f"{sum(xs) / len(xs):.3f}" if xs else "-"

        def last(xs):
            return f"{xs[-1]:.3f}" if xs else "-"

        lines.append(
            f"| {name} | {len(records)} | {mean(reward[:5])} | {mean(reward[-5:])} | "
            f"{ev[0]:.3f} | {ev[-1]:.3f} | {last(ent)} | {last(low)} | {last(high)} |"
            if ev
            else f"| {name} | {len(records)} | {mean(reward[:5])} | {mean(reward[-5:])} | - | - | {last(ent)} | {last(low)} | {last(high)} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
