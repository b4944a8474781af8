"""The README's first command, `examples/run_tiny_bapo.sh`, as a user runs it (on small assets, 1 step)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
