"""tools/summarize_run.py on a run directory written as the trainer writes it: metrics through
`MetricsWriter`, config.yaml, logs. The printed BAPO numbers are checked against values computed
here from the same series, and summary.png must be a readable PNG."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_bapo.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "summarize_run.py"
STEPS = 80


def _load_tool():
    spec = importlib.util.spec_from_file_location("summarize_run", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(run: Path, *, bapo: dict) -> dict[int, dict[str, float]]:
    """Step 0: eval only; step 1: no update (no bapo/actor tags, as when no group finished);
    steps 2..STEPS: an update, the search moving the bounds on some of them; eval every 20."""
    rng = random.Random(7)
    series: dict[int, dict[str, float]] = {}
    writer = MetricsWriter(run / "tb")
    writer.log(0, {"eval/t/avg@2": 0.25, "eval/t/pass@2": 0.4})
    for step in range(1, STEPS + 1):
        m = {"rollout/reward_mean": rng.random(), "rollout/accuracy": rng.random(), "timing/step_s": 1.0}
        if step >= 2:
            moved = rng.random() < (0.8 if step <= 50 else 0.3)
            before = rng.uniform(0.2, 0.39) if moved else rng.uniform(0.4, 0.6)
            m.update({"bapo/rho_before": before, "bapo/rho_after": before + (rng.uniform(0.05, 0.2) if moved else 0.0),
                      "bapo/c_low": 0.6 + 0.02 * rng.randrange(0, 5), "bapo/c_high": 1.2 + 0.05 * rng.randrange(0, 20),
                      "bapo/search_steps": float(rng.randrange(1, 6)) if moved else 0.0,
                      "actor/entropy": 1.0 / step})
        if step % 20 == 0:
            m["eval/t/avg@2"] = step / 100
        writer.log(step, m)
        series[step] = m
    writer.close()
    (run / "config.yaml").write_text(yaml.safe_dump({"trainer": {"output_dir": str(run)}, "actor": {"bapo": bapo}}))
    (run / "logs").mkdir()
    (run / "logs" / "train.log").write_text("2026-01-01 00:00:00,000 [rank0] INFO megatron_bapo.train: start\n")
    return series


def _number(pattern: str, text: str) -> tuple[float, ...]:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text}"
    return tuple(float(g) for g in match.groups())


def test_summary_prints_what_bapo_did_and_writes_a_png(tmp_path):
    run = tmp_path / "run"
    bapo = {"rho0": 0.4, "low_start": 0.6, "low_max": 0.9, "high_start": 1.2, "high_max": 3.0}
    series = _write_run(run, bapo=bapo)
    proc = subprocess.run([sys.executable, str(TOOL), str(run)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout

    # The lines the README quotes keep their format.
    rewards = [series[s]["rollout/reward_mean"] for s in sorted(series)]
    assert f"train reward     first 3 steps {statistics.fmean(rewards[:3]):.3f}  last 3 steps " \
           f"{statistics.fmean(rewards[-3:]):.3f}" in out
    assert "eval/t/avg@2     step 0: 0.250  step 20: 0.200  step 40: 0.400  step 60: 0.600  step 80: 0.800" in out

    updated = [series[s] for s in sorted(series) if "bapo/rho_before" in series[s]]
    before = [m["bapo/rho_before"] for m in updated]
    after = [m["bapo/rho_after"] for m in updated]
    expected = (statistics.fmean(before[:3]), statistics.fmean(after[:3]), statistics.fmean(before[-3:]),
                statistics.fmean(after[-3:]))
    got = _number(r"target rho0 0\.40\): first 3 steps ([\d.]+) -> ([\d.]+)  last 3 steps ([\d.]+) -> ([\d.]+)", out)
    assert got == pytest.approx(expected, abs=6e-4)
    for key in ("c_low", "c_high"):
        vals = [m[f"bapo/{key}"] for m in updated]
        got = _number(rf"bapo {key}\s+min ([\d.]+)  median ([\d.]+)  max ([\d.]+)", out)
        assert got == pytest.approx((min(vals), statistics.median(vals), max(vals)), abs=6e-4)
    moved = sum(m["bapo/search_steps"] > 0 for m in updated)
    early = [m for s, m in series.items() if "bapo/search_steps" in m and s <= 50]
    moved_early = sum(m["bapo/search_steps"] > 0 for m in early)
    assert 0 < moved < len(updated) and len(early) == 49  # the data exercise both counts
    assert f"moved the bounds on {moved} of {len(updated)} updated steps; in the first 50 steps on " \
           f"{moved_early} of 49" in out

    # Where things are: what exists is listed, what does not (no checkpoints, no samples) is not.
    assert f"log           {run / 'logs' / 'train.log'}" in out
    assert f"config        {run / 'config.yaml'}" in out and f"tensorboard   {run / 'tb'}" in out
    assert "samples.jsonl" not in out and "checkpoints" not in out
    png = run / "summary.png"
    assert f"plot          {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.shape[0] >= 300 and image.shape[1] >= 500
    assert not math.isclose(float(image.std()), 0.0), "a blank image"


def test_fixed_clip_run_has_no_rho_target(tmp_path):
    """GRPO's bounds cannot move: no rho0 target is claimed (text or plot)."""
    tool = _load_tool()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {"bapo": {
        "rho0": 0.4, "low_start": 0.8, "low_max": 0.8, "high_start": 1.2, "high_max": 1.2}}}))
    assert tool.target_rho(run) is None
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {"bapo": {
        "rho0": 0.45, "low_start": 0.6, "low_max": 0.9, "high_start": 1.2, "high_max": 3.0}}}))
    assert tool.target_rho(run) == 0.45
    assert tool.target_rho(tmp_path) is None  # no config.yaml


def test_summary_names_the_machine_of_the_run_and_of_its_assets(tmp_path):
    """Two users comparing numbers see why they differ: the CPU kind and torch's kernels the run
    started on (config.yaml's first line) and those that built its tiny assets (their info.json)."""
    from megatron_bapo import run_record

    tool = _load_tool()
    run, assets = tmp_path / "run", tmp_path / "assets"
    run.mkdir()
    (assets / "base_model").mkdir(parents=True)
    here = run_record.machine_record()
    (run / "config.yaml").write_text(run_record.machine_header() + yaml.safe_dump(
        {"model": {"hf_path": str(assets / "base_model")}}))
    amd = {**here, "cpu_model": "AMD EPYC 9B14", "cpu_vendor": "AuthenticAMD"}
    info = {"machine": amd, "sft": {"num_steps": 600},
            "base_accuracy": {"greedy": 0.3724, "num_problems": 500, "split": "test"}}
    (assets / "info.json").write_text(json.dumps(info))
    machine, built = tool.machine_lines(run)
    assert machine == f"machine          {run_record.describe_machine(here)}"
    assert f"CPU capability {here['torch_cpu_capability']}" in machine and here["cpu_model"] in machine
    assert built == (f"assets           {assets}: SFT 600 steps, base greedy 0.372 on 500 test problems; built on "
                     f"AMD EPYC 9B14 (AuthenticAMD, {here['num_cpus']} cpus), torch {here['torch_version']}, "
                     f"CPU capability {here['torch_cpu_capability']}")
    (assets / "info.json").write_text(json.dumps({**info, "machine": here}))
    assert tool.machine_lines(run)[1].endswith("; built on the same machine")
    (assets / "info.json").unlink()
    assert tool.machine_lines(run) == [machine]
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {}}))  # a run from before the header
    assert tool.machine_lines(run) == ["machine          unknown (not recorded)"]


def test_summary_says_what_the_teacher_and_the_judge_did(tmp_path):
    """A run with a teacher and a judge: the reverse KL to the teacher (first vs last steps) and each
    model's counts summed over the run, computed here from the series the writer logged."""
    tool = _load_tool()
    run = tmp_path / "run"
    rng = random.Random(3)
    writer = MetricsWriter(run / "tb")
    logged = []
    for step in range(1, 9):
        m = {"rollout/reward_mean": rng.random(), "distill/reverse_kl_mean": rng.uniform(0.1, 2.0),
             "distill/num_teacher_scored": float(rng.randrange(10, 20)), "distill/num_teacher_failed": float(step % 3 == 0),
             "judge/num_scored": float(rng.randrange(5, 9)), "judge/num_timeout": float(step == 4),
             "judge/num_unparseable": 0.0, "judge/num_error": 0.0, "judge/num_groups_dropped": float(step == 4)}
        if step == 5:  # a teacher restart: rescored, one group still without log-probs dropped
            m.update({"distill/num_teacher_rescored": 6.0, "distill/num_groups_dropped": 1.0})
        writer.log(step, m)
        logged.append(m)
    writer.close()
    kl = [m["distill/reverse_kl_mean"] for m in logged]
    total = {k: sum(m.get(k, 0.0) for m in logged) for k in logged[0] | logged[4]}
    lines = tool.summarize(run)
    assert (f"distill reverse KL first 3 steps {statistics.fmean(kl[:3]):.3f}  last 3 steps "
            f"{statistics.fmean(kl[-3:]):.3f}") in lines
    assert (f"teacher          scored {total['distill/num_teacher_scored']:.0f}, failed 2, rescored 6, groups dropped 1 "
            "(summed over the run)") in lines
    assert (f"judge            scored {total['judge/num_scored']:.0f}, timed out 1, unparseable 0, errors 0, "
            "groups dropped 1 (summed over the run)") in lines
    plain = tmp_path / "plain"  # a run without either: no such lines
    _write_run(plain, bapo={"rho0": 0.4, "low_start": 0.6, "low_max": 0.9, "high_start": 1.2, "high_max": 3.0})
    assert not [ln for ln in tool.summarize(plain) if ln.startswith(("distill", "teacher", "judge"))]
