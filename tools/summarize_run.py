"""Print how a run went and draw it: reward and held-out accuracy at the start vs the end, what
BAPO did, where the outputs are; writes `<run>/summary.png`.

    python tools/summarize_run.py runs/tiny_bapo

Reads `<run>/tb/metrics.jsonl` (written by the trainer next to the TensorBoard events) and
`<run>/config.yaml`: the target balance rho0, the machine the run started on (its first line) and the
model it started from, whose tiny assets' info.json (next to `model.hf_path`) says how the warm start
went and on which machine it was built: the same seeds give other numbers on another CPU kind. A run
with a teacher (distillation) or a judge also gets their lines: the reverse KL to the teacher, and
each model's scored/failed counts summed over the run. The
PNG (matplotlib, Agg) has four panels over steps: train reward with the held-out eval points, policy
entropy, the clip bounds c_low/c_high, and the positive-contribution share rho before and after the
bound search (rho0 dashed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_bapo.metrics import read_jsonl_metrics  # noqa: E402
from megatron_bapo.rewards.judge import ERROR, SCORED, TIMEOUT, UNPARSEABLE  # noqa: E402
from megatron_bapo.rewards.judge import METRIC as JUDGE_METRIC  # noqa: E402
from megatron_bapo.run_record import MACHINE_KEYS, describe_machine, read_machine_header  # noqa: E402

PNG = "summary.png"
EARLY_STEPS = 50  # "in the first 50 steps": how busy the search was while the policy moved most


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) for the records that have `key` with a finite value (NaN/inf are strings in the jsonl)."""
    points = []
    for r in records:
        if key in r:
            value = float(r[key])
            if math.isfinite(value):
                points.append((int(r["step"]), value))
    return points


def _values(records: list[dict[str, Any]], key: str) -> list[float]:
    return [v for _, v in _series(records, key)]


def _eval_keys(records: list[dict[str, Any]], tools: bool = False) -> list[str]:
    """The eval accuracy keys (avg@n); with `tools`, also the tool-call rates of multi-turn runs."""
    return sorted({k for r in records for k in r
                   if k.startswith("eval/") and ("/avg@" in k or (tools and k.endswith("/tool_call_rate")))})


def target_rho(run_dir: Path) -> Optional[float]:
    """`actor.bapo.rho0` from the run's config.yaml; None without one, or for a fixed clip (GRPO,
    clip-higher: the bounds cannot move, so there is no target)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    import yaml

    bapo = ((yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("actor") or {}).get("bapo") or {}
    try:
        adaptive = bapo["low_max"] > bapo["low_start"] or bapo["high_max"] > bapo["high_start"]
        return float(bapo["rho0"]) if adaptive else None
    except (KeyError, TypeError):
        return None


def bapo_lines(records: list[dict[str, Any]], window: int = 3, rho0: Optional[float] = None) -> list[str]:
    """What the bound search did: rho before -> after it (first vs last steps), c_low/c_high
    (min/median/max), and on how many steps it moved the bounds (all steps, the first 50)."""
    before, after = _values(records, "bapo/rho_before"), _values(records, "bapo/rho_after")
    if not before or not after:
        return []
    n = min(window, len(before), len(after))
    target = f" (target rho0 {rho0:.2f})" if rho0 is not None else ""
    lines = [f"bapo rho         before -> after the search{target}: first {n} steps "
             f"{_mean(before[:n]):.3f} -> {_mean(after[:n]):.3f}  last {n} steps "
             f"{_mean(before[-n:]):.3f} -> {_mean(after[-n:]):.3f}"]
    for key in ("c_low", "c_high"):
        vals = _values(records, f"bapo/{key}")
        if vals:
            lines.append(f"bapo {key:<11} min {min(vals):.3f}  median {statistics.median(vals):.3f}  "
                         f"max {max(vals):.3f}")
    searched = _series(records, "bapo/search_steps")
    if searched:
        early = [s for s in searched if s[0] <= EARLY_STEPS]
        lines.append(f"bapo search      moved the bounds on {sum(v > 0 for _, v in searched)} of {len(searched)} "
                     f"updated steps; in the first {EARLY_STEPS} steps on {sum(v > 0 for _, v in early)} of {len(early)}")
    return lines


TEACHER_COUNTS = (("distill/num_teacher_scored", "scored"), ("distill/num_teacher_failed", "failed"),
                  ("distill/num_teacher_rescored", "rescored"), ("distill/num_groups_dropped", "groups dropped"))
JUDGE_COUNTS = ((JUDGE_METRIC[SCORED], "scored"), (JUDGE_METRIC[TIMEOUT], "timed out"),
                (JUDGE_METRIC[UNPARSEABLE], "unparseable"), (JUDGE_METRIC[ERROR], "errors"),
                ("judge/num_groups_dropped", "groups dropped"))


def second_model_lines(records: list[dict[str, Any]], window: int = 3) -> list[str]:
    """What the teacher and the judge did, when the run had them: the distillation's reverse KL (the
    mean log-prob gap to the teacher, first vs last steps) and each model's counts summed over the run
    (a teacher or judge that failed often shows here, not only in a step's line)."""
    lines = []
    kl = _values(records, "distill/reverse_kl_mean")
    if kl:
        n = min(window, len(kl))
        lines.append(f"distill reverse KL first {n} steps {_mean(kl[:n]):.3f}  last {n} steps {_mean(kl[-n:]):.3f}")
    for name, counts in (("teacher", TEACHER_COUNTS), ("judge", JUDGE_COUNTS)):
        totals = [(label, sum(values)) for key, label in counts if (values := _values(records, key))]
        if totals:
            lines.append(f"{name:<16} " + ", ".join(f"{label} {total:.0f}" for label, total in totals)
                         + " (summed over the run)")
    return lines


def machine_lines(run_dir: Path) -> list[str]:
    """The machine the run started on (config.yaml's header) and, when `model.hf_path` sits in tiny
    assets (an info.json next to it), their warm start and the machine that built them."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return []
    import yaml

    text = path.read_text(encoding="utf-8")
    machine = read_machine_header(text)
    lines = [f"{'machine':<16} {describe_machine(machine)}"]
    hf_path = ((yaml.safe_load(text) or {}).get("model") or {}).get("hf_path")
    info_path = Path(str(hf_path)).parent / "info.json" if hf_path else None
    if info_path is None or not info_path.is_file():
        return lines
    info = json.loads(info_path.read_text(encoding="utf-8"))
    built = info.get("machine")
    same = built and machine and all(built.get(k) == machine.get(k) for k in MACHINE_KEYS)
    sft, base = info.get("sft") or {}, info.get("base_accuracy") or {}
    greedy = base.get("greedy")
    quality = (f", base greedy {greedy:.3f} on {base.get('num_problems')} {base.get('split', 'test')} problems"
               if isinstance(greedy, (int, float)) else "")
    lines.append(f"{'assets':<16} {info_path.parent}: SFT {sft.get('num_steps')} steps{quality}; built on "
                 + ("the same machine" if same else describe_machine(built)))
    return lines


def output_lines(run_dir: Path, png: Optional[Path]) -> list[str]:
    """Where the run's outputs are (those that exist)."""
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir() and "." not in p.name)
    latest = run_dir / "checkpoints" / "latest"
    entries = [
        ("tensorboard", run_dir / "tb", f"(.venv/bin/tensorboard --logdir {run_dir / 'tb'}; scalars also in metrics.jsonl)"),
        ("checkpoints", run_dir / "checkpoints",
         f"({', '.join(ckpts)}; latest {latest.read_text().strip()})" if ckpts and latest.exists() else ""),
        ("samples", run_dir / "samples.jsonl", "(prompts drawn and groups trained per step)"),
        ("eval records", run_dir / "eval", "(responses and scores per eval)"),
        ("log", run_dir / "logs" / "train.log", "(everything the trainer logged; servers: logs/server_*.log)"),
        ("config", run_dir / "config.yaml", "(the resolved config)"),
    ]
    lines = ["outputs"]
    for label, path, note in entries:
        if path.exists():
            lines.append(f"  {label:<13} {path}  {note}".rstrip())
    if png is not None:
        lines.append(f"  {'plot':<13} {png}  (reward/eval, entropy, clip bounds, rho)")
    return lines


def summarize(run_dir: Path, window: int = 3) -> list[str]:
    """The reward/eval lines (format quoted in the README) and the BAPO lines."""
    records = read_jsonl_metrics(run_dir / "tb")
    if not records:
        raise SystemExit(f"{run_dir}/tb/metrics.jsonl has no records; did the run start?")
    lines = [f"run: {run_dir} ({max(r['step'] for r in records)} steps)"] + machine_lines(run_dir)
    train = [r for r in records if "rollout/reward_mean" in r]
    for key, label in (("rollout/reward_mean", "train reward"), ("rollout/accuracy", "train accuracy"),
                       ("rollout/tool_call_rate", "train tool calls")):
        vals = [float(r[key]) for r in train if key in r]
        if vals:
            lines.append(f"{label:<16} first {min(window, len(vals))} steps {_mean(vals[:window]):.3f}  "
                         f"last {min(window, len(vals))} steps {_mean(vals[-window:]):.3f}")
    for key in _eval_keys(records, tools=True):
        points = [(r["step"], float(r[key])) for r in records if key in r]
        lines.append(f"{key:<16} " + "  ".join(f"step {s}: {v:.3f}" for s, v in points))
    lines += bapo_lines(records, window, target_rho(run_dir))
    return lines + second_model_lines(records, window)


def plot(run_dir: Path, out: Path) -> Path:
    """Four panels over steps: reward (+ eval points), entropy, c_low/c_high, rho before/after (+ rho0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl_metrics(run_dir / "tb")
    rho0 = target_rho(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4), dpi=80, sharex=True)
    (reward_ax, entropy_ax), (bounds_ax, rho_ax) = axes

    def line(ax, key: str, label: str, **kw) -> None:
        points = _series(records, key)
        if points:
            ax.plot(*zip(*points), label=label, linewidth=1.2, **kw)

    reward = _series(records, "rollout/reward_mean")
    line(reward_ax, "rollout/reward_mean", "train reward", alpha=0.4 if len(reward) >= 20 else 0.8)
    if len(reward) >= 20:  # a step's reward is noisy (one batch): the trend as a 10-step mean
        steps, values = zip(*reward)
        smooth = [statistics.fmean(values[max(0, i - 9):i + 1]) for i in range(len(values))]
        reward_ax.plot(steps, smooth, label="train reward, 10-step mean", linewidth=1.6, color="C0")
    for key in _eval_keys(records):
        line(reward_ax, key, f"held-out {key[len('eval/'):]}", marker="o", markersize=4)
    reward_ax.set_title("reward (train rollouts) and held-out eval", fontsize=10)
    line(entropy_ax, "actor/entropy", "entropy")
    entropy_ax.set_title("policy entropy (loss tokens)", fontsize=10)
    line(bounds_ax, "bapo/c_high", "c_high")
    line(bounds_ax, "bapo/c_low", "c_low")
    bounds_ax.set_title("clip bounds chosen by the search", fontsize=10)
    line(rho_ax, "bapo/rho_before", "before the search")
    line(rho_ax, "bapo/rho_after", "after the search")
    if rho0 is not None:
        rho_ax.axhline(rho0, linestyle="--", color="gray", linewidth=1, label=f"target rho0 {rho0:g}")
    rho_ax.set_title("positive-contribution share rho", fontsize=10)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(str(run_dir), fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--no-plot", action="store_true", help=f"do not write <run>/{PNG}")
    args = parser.parse_args()
    lines = summarize(args.run_dir)
    png = None
    if not args.no_plot:
        try:
            png = plot(args.run_dir, args.run_dir / PNG)
        except ImportError:
            lines.append(f"({PNG} not written: matplotlib is not installed; pip install 'megatron_bapo[plots]')")
    print("\n".join(lines + output_lines(args.run_dir, png)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
