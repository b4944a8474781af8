"""tools/plot_study.py on runs written by the real MetricsWriter: seed aggregation in the table, PNGs."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_runs_with_dynamic_sampling_get_an_algorithms_table(tmp_path):
    """Eval before / after with 95% t-intervals over seeds, updated steps, groups per updated step,
    refill rounds and cap hits, wall time."""
    for name, (before, after) in (("s1", (0.1, 0.5)), ("s2", (0.2, 0.4)), ("s3", (0.1, 0.6))):
        writer = MetricsWriter(tmp_path / name / "tb")
        for step in range(0, 11):
            scalars = {"train/updated": float(step != 1), "timing/step_s": 6.0, "rollout/zero_variance_frac": 0.25,
                       "rollout/refill_rounds": 2.0, "rollout/refill_cap_hit": float(step == 3),
                       "experience/num_groups": 16.0 if step != 1 else 0.0, "bapo/rho_before": 0.3,
                       "bapo/rho_after": 0.4}
            if step in (0, 5, 10):
                scalars["eval/t/avg@4"] = {0: before, 5: (before + after) / 2, 10: after}[step]
            writer.log(step, scalars)
        writer.close()
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "tools/plot_study.py"), "--out", str(out), "--runs",
                          f"refill={tmp_path / 's1'},{tmp_path / 's2'},{tmp_path / 's3'}"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = (out / "table.md").read_text()
    row = next(line for line in text.split("Policy losses and dynamic sampling")[1].splitlines()
               if line.startswith("| refill")).split("|")[2:-1]
    cells = [c.strip() for c in row]
    ends = [statistics.fmean([(0.1 + 0.5) / 2, 0.5]), statistics.fmean([0.3, 0.4]), statistics.fmean([0.35, 0.6])]
    half = 4.303 * statistics.stdev(ends) / 3 ** 0.5
    m = statistics.fmean(ends)
    assert cells[1] == f"{m:.3f} [{m - half:.3f}, {m + half:.3f}]"
    assert cells[0].startswith("0.133 [") and cells[4] == "0.30 / 0.40"
    assert cells[5] == "10.0 of 11" and cells[6] == "16.0" and cells[7] == "0.25" and cells[8] == "2.00"
    assert cells[9] == "1.0" and cells[10] == "1.1"  # 11 steps x 6 s
    assert (out / "refill_rounds.png").stat().st_size > 1000 and (out / "zero_variance.png").stat().st_size > 1000
