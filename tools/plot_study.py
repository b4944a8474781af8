"""Summarise and plot a study of the tiny task: several arms (presets, losses, ...), each run with one or more seeds.

    python tools/plot_study.py --out results/staleness_study \
        --runs grpo=runs/study/grpo/s1,runs/study/grpo/s2 bapo=runs/study/bapo/s1,runs/study/bapo/s2

Reads each run's `tb/metrics.jsonl` (written by the trainer). Writes `table.md` (per preset: eval
accuracy at the start, at the end and its best, each as mean +- std over seeds with the per-seed
values; final train reward, entropy and clip bounds; when the runs log `mismatch/*`, a second
table of the training-inference mismatch and the importance corrections; when they log
`rollout/zero_variance_frac` (dynamic sampling), a third of eval before / after with 95% intervals,
entropy, positive contribution, updated steps, trained groups, refill and wall time) and small PNGs
(seed-mean curves with a min-max band) to `--out`. A single seed is a valid input; the std column
then reads 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_bapo.metrics import read_jsonl_metrics  # noqa: E402

PLOTS = {
    "reward.png": ("Mean reward (train rollouts, 10-step mean)", ["rollout/reward_mean"]),
    "eval_accuracy.png": ("Eval accuracy (held-out avg@n)", ["eval/*/avg@*"]),
    "entropy.png": ("Policy entropy (loss tokens)", ["actor/entropy"]),
    "clip_bounds.png": ("Clip bounds", ["bapo/c_low", "bapo/c_high"]),
    "positive_contribution.png": ("Positive contribution share (before / after the search)",
                                  ["bapo/rho_before", "bapo/rho_after"]),
    "clip_fractions.png": ("Clipped token fraction by advantage sign", ["actor/clipfrac_pos", "actor/clipfrac_neg"]),
    "grad_norm.png": ("Gradient norm", ["actor/grad_norm"]),
    "mismatch.png": ("KL(rollout || train) by version lag (lag 0: mismatch only)",
                     ["mismatch/kl_k3", "mismatch/lag1/kl_k3", "mismatch/lag3plus/kl_k3"]),
    "correction.png": ("Importance correction (recompute): mean weight", ["correction/weight_mean"]),
    "zero_variance.png": ("Share of finished groups with equal rewards", ["rollout/zero_variance_frac"]),
    "trained_groups.png": ("Groups trained per step", ["experience/num_groups"]),
    "refill_rounds.png": ("Refill rounds per step (rollout.dynamic_sampling: refill)", ["rollout/refill_rounds"]),
}
LOG_SCALE = {"mismatch.png"}
"""Plots whose values span orders of magnitude (lag-0 mismatch vs drift)."""
MISMATCH_COLUMNS = (
    ("KL lag 0", "mismatch/kl_k3", ".2e"), ("mean abs d lag 0", "mismatch/abs_diff_mean", ".2e"),
    ("KL lag 1", "mismatch/lag1/kl_k3", ".2e"), ("KL lag 2", "mismatch/lag2/kl_k3", ".2e"),
    ("KL lag 3+", "mismatch/lag3plus/kl_k3", ".2e"), ("outside band lag 3+", "mismatch/lag3plus/frac_outside_band", ".3f"),
    ("ratio KL (actor/kl)", "actor/kl", ".2e"), ("clipped", "actor/clipfrac", ".3f"),
    ("weight mean", "correction/weight_mean", ".4f"), ("masked", "correction/masked_frac", ".4f"),
)
"""Columns of the mismatch table (means over every step, then over seeds), written when runs log `mismatch/*`."""


def _resolve(records: list[dict], tag: str) -> str:
    """`eval/*/avg@*` -> the first matching eval tag of the run (dataset names differ between runs)."""
    if "*" not in tag:
        return tag
    return next((k for r in records for k in sorted(r) if k.startswith("eval/") and "/avg@" in k), tag)


def _series(records: list[dict], tag: str) -> dict[int, float]:
    tag = _resolve(records, tag)
    return {int(r["step"]): float(r[tag]) for r in records if isinstance(r.get(tag), (int, float))}


def _smooth(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _across_seeds(seeds: list[list[dict]], tag: str, window: int = 1):
    """Steps present in every seed, with the seed mean, min and max (after per-seed smoothing)."""
    per_seed = []
    for records in seeds:
        s = _series(records, tag)
        steps = sorted(s)
        per_seed.append(dict(zip(steps, _smooth([s[k] for k in steps], window))))
    common = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    cols = [[s[k] for s in per_seed] for k in common]
    return common, [statistics.fmean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def _mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} +- {std:.3f}"


def _table(runs: dict[str, list[list[dict]]]) -> list[str]:
    lines = [
        "| preset | seeds | eval start | eval end (mean of last 2 evals) | eval best | per-seed eval end | "
        "reward last 10 | entropy last 10 | c_low / c_high last | search moved (first 50 steps) | "
        "rho before (first 10) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, seeds in runs.items():
        start, end, best, reward, entropy, low, high, moved, rho = [], [], [], [], [], [], [], [], []
        for records in seeds:
            ev = _series(records, "eval/*/avg@*")
            ev_values = [ev[k] for k in sorted(ev)]
            if ev_values:
                start.append(ev_values[0])
                end.append(statistics.fmean(ev_values[-2:]))
                best.append(max(ev_values))
            for tag, out in (("rollout/reward_mean", reward), ("actor/entropy", entropy)):
                s = _series(records, tag)
                tail = [s[k] for k in sorted(s)][-10:]
                if tail:
                    out.append(statistics.fmean(tail))
            for tag, out in (("bapo/c_low", low), ("bapo/c_high", high)):
                s = _series(records, tag)
                if s:
                    out.append(s[max(s)])
            searched = _series(records, "bapo/search_steps")
            early = [searched[k] for k in sorted(searched) if k <= 50]
            if early:
                moved.append(sum(v > 0 for v in early) / len(early))
            before = _series(records, "bapo/rho_before")
            if before:
                rho.append(statistics.fmean([before[k] for k in sorted(before)][:10]))
        bounds = f"{statistics.fmean(low):.2f} / {statistics.fmean(high):.2f}" if low and high else "-"
        lines.append(
            f"| {name} | {len(seeds)} | {_mean_std(start)} | {_mean_std(end)} | {_mean_std(best)} | "
            f"{', '.join(f'{v:.3f}' for v in end) or '-'} | {_mean_std(reward)} | {_mean_std(entropy)} | {bounds} | "
            f"{f'{statistics.fmean(moved):.0%}' if moved else '-'} | {_mean_std(rho)} |"
        )
    return lines


def _mismatch_table(runs: dict[str, list[list[dict]]]) -> list[str]:
    """Per preset: each `MISMATCH_COLUMNS` metric averaged over the steps that log it, mean +- std over seeds."""
    lines = ["| preset | " + " | ".join(name for name, _, _ in MISMATCH_COLUMNS) + " |",
             "|---|" + "---|" * len(MISMATCH_COLUMNS)]
    for name, seeds in runs.items():
        cells = []
        for _, tag, fmt in MISMATCH_COLUMNS:
            per_seed = [statistics.fmean(s.values()) for s in (_series(r, tag) for r in seeds) if s]
            std = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
            cells.append(f"{statistics.fmean(per_seed):{fmt}} +- {std:{fmt}}" if per_seed else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Two-sided 95% Student t quantiles by degrees of freedom (seeds - 1)."""


def _interval(values: list[float]) -> str:
    """`mean [lo, hi]`: the 95% t-interval of the mean over seeds (one seed: the value alone)."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.3f}"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]"


def _mean_of(records: list[dict], tag: str, where=None) -> float | None:
    s = _series(records, tag)
    vals = [v for k, v in sorted(s.items()) if where is None or where(k)]
    return statistics.fmean(vals) if vals else None


def _algorithms_table(runs: dict[str, list[list[dict]]]) -> list[str]:
    """Per arm: eval before / after (95% t-intervals over seeds), entropy (last 10 steps), positive
    contribution before / after the balance search (mean over steps), steps that updated, groups
    trained per updated step, zero-variance share, refill rounds and cap hits per step, wall time."""
    lines = ["| arm | eval before | eval after (mean of last 2 evals) | after - before | entropy last 10 | "
             "rho before / after | updated steps | groups / updated step | zero-var share | refill rounds / step | "
             "refill cap hits | wall min |", "|---|" + "---|" * 11]
    for name, seeds in runs.items():
        cols: dict[str, list[float]] = {k: [] for k in ("before", "after", "gain", "entropy", "rho_b", "rho_a", "updated",
                                                          "groups", "zero", "refill", "caps", "wall")}
        for records in seeds:
            ev = _series(records, "eval/*/avg@*")
            ev_values = [ev[k] for k in sorted(ev)]
            if len(ev_values) >= 2:
                cols["before"].append(ev_values[0])
                cols["after"].append(statistics.fmean(ev_values[-2:]))
                cols["gain"].append(cols["after"][-1] - cols["before"][-1])
            entropy = _series(records, "actor/entropy")
            if entropy:
                cols["entropy"].append(statistics.fmean([entropy[k] for k in sorted(entropy)][-10:]))
            updated = _series(records, "train/updated")
            cols["updated"].append(sum(updated.values()))
            for key, tag, where in (("rho_b", "bapo/rho_before", None), ("rho_a", "bapo/rho_after", None),
                                    ("groups", "experience/num_groups", lambda k: updated.get(k)),
                                    ("zero", "rollout/zero_variance_frac", None), ("refill", "rollout/refill_rounds", None)):
                value = _mean_of(records, tag, where)
                if value is not None:
                    cols[key].append(value)
            caps = _series(records, "rollout/refill_cap_hit")
            if caps:
                cols["caps"].append(sum(caps.values()))
            cols["wall"].append(sum(_series(records, "timing/step_s").values()) / 60)

        def mean(key: str, fmt: str = ".3f") -> str:
            return f"{statistics.fmean(cols[key]):{fmt}}" if cols[key] else "-"

        steps = max((len(_series(r, "train/updated")) for r in seeds), default=0)
        lines.append(
            f"| {name} | {_interval(cols['before'])} | {_interval(cols['after'])} | {_interval(cols['gain'])} | "
            f"{mean('entropy')} | {mean('rho_b', '.2f')} / {mean('rho_a', '.2f')} | {mean('updated', '.1f')} of {steps} | "
            f"{mean('groups', '.1f')} | {mean('zero', '.2f')} | {mean('refill', '.2f')} | {mean('caps', '.1f')} | "
            f"{mean('wall', '.1f')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="name=run_dir[,run_dir...] (one dir per seed)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[list[dict]]] = {}
    for item in args.runs:
        name, _, paths = item.partition("=")
        if not paths:
            parser.error(f"--runs expects name=run_dir[,run_dir...], got {item!r}")
        runs[name] = []
        for path in paths.split(","):
            records = read_jsonl_metrics(Path(path) / "tb")
            if not records:
                parser.error(f"run {name!r}: no metrics in {Path(path) / 'tb' / 'metrics.jsonl'}")
            runs[name].append(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    for filename, (title, tags) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
        drawn = False
        for name, seeds in runs.items():
            for tag in tags:
                steps, mean, lo, hi = _across_seeds(seeds, tag, window=10 if "reward" in tag else 1)
                if not steps:
                    continue
                label = name if len(tags) == 1 else f"{name} {tag.split('/', 1)[-1]}"
                (line,) = ax.plot(steps, mean, label=label, linewidth=1.4)
                if len(seeds) > 1:
                    ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        if filename in LOG_SCALE:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / filename)
        plt.close(fig)

    lines = _table(runs)
    if any("mismatch/kl_k3" in r for seeds in runs.values() for records in seeds for r in records):
        lines += ["", "Training-inference mismatch (means over the steps that log each metric):", ""]
        lines += _mismatch_table(runs)
    if any("rollout/zero_variance_frac" in r for seeds in runs.values() for records in seeds for r in records):
        lines += ["", "Policy losses and dynamic sampling (intervals: 95% over seeds; the other columns: seed means):", ""]
        lines += _algorithms_table(runs)
    (out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
