"""The image's pins resolve together (`tools/check_image_pins.py`), checked in CI without Docker: pip
resolves SGLang, its router, the torch SGLang pins, megatron-core, Transformer Engine (its prebuilt
core and its PyTorch extension's requirements) and this project for the image's Python 3.12 on
x86-64 from the wheels' metadata alone (`--dry-run --only-binary=:all:`, no wheel downloaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_sglang_megatron_core_te_and_torch_resolve_to_one_set(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_image_pins.py"), "--report", str(report)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    pins = dict(ln.split("=", 1) for ln in (ROOT / "pins.env").read_text().splitlines()
                if ln.strip() and not ln.startswith("#"))
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    assert got["torch"] == pins["TORCH_VERSION"]
    assert got["sglang"] == pins["SGLANG_VERSION"] and got["megatron-core"] == pins["MEGATRON_CORE_VERSION"]
    te = pins["TRANSFORMER_ENGINE_VERSION"]
    assert got["transformer-engine"] == te and got[f"transformer-engine-{pins['TRANSFORMER_ENGINE_CUDA']}"] == te
    assert "nvidia-nccl-cu13" in got, "torch's NCCL is the CUDA major TE's core was picked for"
    assert all(i["download_info"]["url"].endswith(".whl") for i in json.loads(report.read_text())["install"])
