"""tools/plot_study.py on runs written by the real MetricsWriter: seed aggregation in the table, PNGs."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from megatron_bapo.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[1]


def _run(path: Path, evals: list[float], reward: float) -> None:
    writer = MetricsWriter(path / "tb")
    for step in range(0, 21):
        scalars = {"rollout/reward_mean": reward + 0.01 * step, "actor/entropy": 0.5, "bapo/c_low": 0.6,
                   "bapo/c_high": 1.2 + 0.05 * (step % 3)}
        if step % 10 == 0:
            scalars["eval/tiny_test/avg@4"] = evals[step // 10]
        writer.log(step, scalars)
    writer.close()


def test_table_aggregates_seeds_and_plots_are_written(tmp_path):
    _run(tmp_path / "a1", [0.1, 0.3, 0.5], 0.2)
    _run(tmp_path / "a2", [0.2, 0.4, 0.8], 0.4)
    _run(tmp_path / "b1", [0.1, 0.2, 0.2], 0.1)
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools/plot_study.py"), "--out", str(out),
         "--runs", f"a={tmp_path / 'a1'},{tmp_path / 'a2'}", f"b={tmp_path / 'b1'}"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in (out / "table.md").read_text().splitlines()[2:]}
    ends = [statistics.fmean([0.3, 0.5]), statistics.fmean([0.4, 0.8])]
    assert rows["a"][0] == "2"
    assert rows["a"][1] == f"{statistics.fmean([0.1, 0.2]):.3f} +- {statistics.stdev([0.1, 0.2]):.3f}"
    assert rows["a"][2] == f"{statistics.fmean(ends):.3f} +- {statistics.stdev(ends):.3f}"
    assert rows["a"][3] == f"{statistics.fmean([0.5, 0.8]):.3f} +- {statistics.stdev([0.5, 0.8]):.3f}"
    assert rows["a"][4] == ", ".join(f"{v:.3f}" for v in ends)
    assert rows["b"][2] == "0.200 +- 0.000" and rows["b"][7] == "0.60 / 1.30"  # last step 20: 1.2 + 0.05 * 2
    for png in ("reward.png", "eval_accuracy.png", "entropy.png", "clip_bounds.png"):
        assert (out / png).stat().st_size > 1000


def test_a_run_without_metrics_is_an_error_naming_it(tmp_path):
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools/plot_study.py"), "--out", str(tmp_path / "o"), "--runs", f"x={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2 and "run 'x'" in res.stderr


def test_runs_with_mismatch_metrics_get_a_mismatch_table(tmp_path):
    for name, kl in (("r1", 1e-3), ("r2", 3e-3)):
        writer = MetricsWriter(tmp_path / name / "tb")
        for step in range(1, 5):
            writer.log(step, {"eval/t/avg@4": 0.1, "mismatch/kl_k3": kl * step, "correction/weight_mean": 0.99})
        writer.close()
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "tools/plot_study.py"), "--out", str(out), "--runs",
                          f"tis={tmp_path / 'r1'},{tmp_path / 'r2'}"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = (out / "table.md").read_text()
    row = next(line for line in text.split("Training-inference mismatch")[1].splitlines() if line.startswith("| tis"))
    means = [statistics.fmean([k * s for s in range(1, 5)]) for k in (1e-3, 3e-3)]
    assert row.split("|")[2].strip() == f"{statistics.fmean(means):.2e} +- {statistics.stdev(means):.2e}"
    assert row.split("|")[-2].strip() == "-"  # masked share never logged
    assert (out / "mismatch.png").stat().st_size > 1000
