"""The README's first command, `examples/run_tiny_bapo.sh`, as a user runs it (on small assets, 1 step)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_script_summarizes_the_run_it_trained_where_output_dir_moved_it(tmp_path):
    """`trainer.output_dir=...` on the command line moves the run; the summary, the plot and the
    outputs listed must be that run's. The script used to summarize runs/tiny_bapo (an older run, or
    nothing) while training elsewhere: a user comparing settings read the same numbers twice."""
    assets = tmp_path / "assets"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny.py"), "--out", str(assets), "--sft-steps", "4",
                    "--seed", "3", "--num-eval", "40"], check=True, capture_output=True, timeout=300)
    out = tmp_path / "moved"
    proc = subprocess.run(["bash", str(REPO / "examples" / "run_tiny_bapo.sh"), f"trainer.output_dir={out}",
                           "trainer.total_steps=1", "trainer.save_every=1", "eval.every_n_steps=0",
                           "trainer.progress=false"],
                          env={**os.environ, "TINY_DIR": str(assets), "OUT": str(tmp_path / "default")},
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"tensorboard   {out}/tb" in log and f"plot          {out}/summary.png" in log, log[-3000:]
    assert (out / "summary.png").is_file() and (out / "tb" / "metrics.jsonl").is_file()
    assert not (tmp_path / "default").exists()
    assert "timings: install" in proc.stdout.splitlines()[-1]
    # The summary names the CPU kind and torch's kernels of the run and of the assets (issue 43: two
    # users comparing numbers must see that they ran on different machines), as recorded on disk.
    import json

    import torch

    from megatron_bapo.config import load_run_config
    from megatron_bapo.run_record import describe_machine, read_machine_header

    text = (out / "config.yaml").read_text()
    machine = read_machine_header(text)
    assert machine is not None and machine["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert load_run_config(out / "config.yaml").trainer.output_dir == str(out)  # the header is a comment
    assert f"machine          {describe_machine(machine)}" in proc.stdout
    assert json.loads((assets / "info.json").read_text())["machine"]["cpu_model"] == machine["cpu_model"]
    assert f"assets           {assets}: SFT 4 steps, base greedy " in proc.stdout
    assert "; built on the same machine" in proc.stdout


def test_ci_prints_the_suites_wall_time_and_slowest_tests_and_exits_with_pytests_status(tmp_path):
    """`.ci/run` around a stand-in for the test command (pytest on two small tests, one failing, under
    the project's pytest.ini): the CI record shows the wall time and the 25 slowest tests, and the
    job fails when a test does."""
    import shutil

    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    shutil.copy(REPO / "pytest.ini", tmp_path / "pytest.ini")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "run_tests.sh").write_text(f'exec "{sys.executable}" -m pytest -q "$@"\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_two.py").write_text("def test_passes():\n    pass\n\n\n"
                                                    "def test_fails():\n    assert False\n")
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run"), "-p", "no:cacheprovider"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("ci: start 20") and "slowest 25 durations" in proc.stdout
    assert re.fullmatch(r"ci: end 20\S+Z, wall time \d+ s \(\d+ min \d+ s\), exit status 1", lines[-1]), lines[-1]
    assert "1 failed, 1 passed" in proc.stdout
