"""tools/convert_hf.py in a subprocess: both directions, --dtype, --force, named errors (~15 s per call)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from convert_helpers import make_hf_model, read_safetensors_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf.py"), "--no-progress", *args],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_cli_both_directions_force_and_errors(tmp_path):
    hf_dir = make_hf_model("llama", tmp_path / "hf", seed=6)
    mdir, back = tmp_path / "mg", tmp_path / "back"
    r = _cli("--to-megatron", "--hf-path", str(hf_dir), "--megatron-path", str(mdir), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    r = _cli("--to-megatron", "--hf-path", str(hf_dir), "--megatron-path", str(mdir))
    assert r.returncode == 2 and "exists; pass --force" in r.stderr
    r = _cli("--to-hf", "--megatron-path", str(mdir), "--hf-path", str(back), "--hf-template", str(hf_dir),
             "--max-shard-size", "40KB")
    assert r.returncode == 0, r.stderr
    src, dst = read_safetensors_dir(hf_dir), read_safetensors_dir(back)
    assert sorted(src) == sorted(dst)
    for k in src:
        assert dst[k].dtype == torch.bfloat16 and torch.equal(src[k].to(torch.bfloat16), dst[k]), k
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(back)).dtype == torch.bfloat16
