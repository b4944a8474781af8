"""The real SGLang server's CPU venv (`tools/install.sh --with-sglang`, `sglang_cpu/`).

The project's `sgl_kernel` stand-in against the definition of the kernel it replaces; that it
registers no `torch.ops.sgl_kernel` operator (so SGLang takes its torch-native path) and fails loudly
for every other name; the requirement list computed from SGLang's metadata; and the built venv itself:
complete, CPU-only, the stand-in and a torchvision that imports on the path SGLang's server runs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "sglang_cpu" / "site" / "sgl_kernel" / "__init__.py"
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def load_standin():
    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", STANDIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_requirements_tool():
    spec = importlib.util.spec_from_file_location("sglang_cpu_requirements", ROOT / "sglang_cpu" / "requirements.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def triton_kernel_literal(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """SGLang's Triton `assign_req_to_token_pool` (srt/mem_cache/allocation.py) transcribed one program
    (request) and one element at a time: program `pid` reads from `out_cache_loc` at the sum of the
    earlier programs' lengths and stores into row `req_pool_indices[pid]` from `start_offset[pid]`."""
    for pid in range(len(req_pool_indices)):
        kv_start, kv_end = int(start_offset[pid]), int(end_offset[pid])
        out_offset = sum(int(end_offset[j]) - int(start_offset[j]) for j in range(pid))
        row = int(req_pool_indices[pid])
        for k in range(kv_end - kv_start):
            assert row * pool_len + kv_start + k < req_to_token.numel()
            req_to_token[row, kv_start + k] = out_cache_loc[out_offset + k]


@st.composite
def assignments(draw):
    num_rows = draw(st.integers(1, 6))
    pool_len = draw(st.integers(1, 12))
    batch = draw(st.integers(0, num_rows))
    rows = draw(st.permutations(range(num_rows)))[:batch]  # a batch's requests hold distinct rows
    starts, ends = [], []
    for _ in rows:
        s = draw(st.integers(0, pool_len))
        starts.append(s)
        ends.append(draw(st.integers(s, pool_len)))
    total = sum(e - s for s, e in zip(starts, ends))
    extra = draw(st.integers(0, 3))  # SGLang's out_cache_loc can be longer than what is written
    return num_rows, pool_len, rows, starts, ends, total + extra


@settings(max_examples=300, deadline=None)
@given(assignments())
def test_assign_req_to_token_pool_cpu_equals_the_triton_kernel(case):
    num_rows, pool_len, rows, starts, ends, num_slots = case
    standin = load_standin()
    gen = torch.Generator().manual_seed(num_slots)
    table = torch.randint(0, 1000, (num_rows, pool_len), dtype=torch.int32, generator=gen)
    loc = torch.randint(1000, 5000, (num_slots,), dtype=torch.int64, generator=gen)
    args = [torch.tensor(rows, dtype=torch.int64), None, torch.tensor(starts, dtype=torch.int64),
            torch.tensor(ends, dtype=torch.int64), loc, pool_len]
    expected, got = table.clone(), table.clone()
    triton_kernel_literal(args[0], expected, args[2], args[3], loc, pool_len)
    args[1] = got
    standin.assign_req_to_token_pool_cpu(*args)
    assert torch.equal(got, expected)
    assert got.dtype == torch.int32


def test_assign_req_to_token_pool_cpu_refuses_what_the_kernel_would_write_out_of_bounds():
    standin = load_standin()
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="pool_len=4"):
        standin.assign_req_to_token_pool_cpu(torch.tensor([0]), table, torch.tensor([2]), torch.tensor([5]),
                                             torch.arange(8), 4)
    with pytest.raises(ValueError, match="out_cache_loc has 2"):
        standin.assign_req_to_token_pool_cpu(torch.tensor([0]), table, torch.tensor([0]), torch.tensor([3]),
                                             torch.arange(2), 4)
    assert torch.equal(table, torch.zeros(2, 4, dtype=torch.int32))


def test_every_other_name_imports_and_fails_loudly_when_called():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch\n"
            "from sgl_kernel import fused_experts, silu_and_mul\n"
            "import sgl_kernel\n"
            "print(sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith('sgl_kernel::')))\n"
            "print(hasattr(torch.ops.sgl_kernel, 'convert_weight_packed'), hasattr(sgl_kernel, '__version__'))\n"
            "try:\n    fused_experts(torch.zeros(1))\nexcept NotImplementedError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(STANDIN.parent.parent)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    ops, probes, error = out.stdout.strip().splitlines()
    assert ops == "[]"  # no torch.ops.sgl_kernel operator: SGLang's cpu_has_amx_support() is False
    assert probes == "False False"  # dunders are plain misses (introspection, version checks)
    assert "sgl_kernel.fused_experts was called" in error and "assign_req_to_token_pool_cpu" in error


def test_cpu_requirements_drop_cuda_only_ones_and_pin_the_cpu_torch():
    tool = load_requirements_tool()
    requires = ["aiohttp", "torch==2.14.1", "torchvision", "sglang-kernel==0.4.10", "flashinfer_python[cu13]==0.7.2",
                "nvidia-cutlass-dsl[cu13]==4.8.0", "nvidia-ml-py", "cuda-python>=13.0", "timm==1.0.25",
                'av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"',
                'decord2; platform_machine == "x86_64"', 'pytest; extra == "test"']
    env = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.11"}
    got = tool.cpu_requirements(requires, torch_version="2.13.0", environment=env)
    assert got == ["aiohttp", "decord2", "nvidia-ml-py", "timm==1.0.25", "torch==2.13.0", "torchvision"]


def test_the_frozen_list_is_for_the_pinned_sglang_and_the_cpu_torch():
    pins = dict(line.split("=", 1) for line in (ROOT / "pins.env").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
    lines = [ln for ln in (ROOT / "sglang_cpu" / "requirements.txt").read_text().splitlines()
             if ln and not ln.startswith("#")]
    assert f"sglang=={pins['SGLANG_VERSION']}" in lines
    assert "torch==2.13.0" in lines
    tool = load_requirements_tool()
    assert [ln for ln in lines if tool.is_cuda_only(ln.split("==")[0])] == []
    assert all("==" in ln for ln in lines), "every line pinned"


@pytest.fixture(scope="module")
def sglang_python():
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run bash tools/install.sh --with-sglang (tools/run_tests.sh does)")
    return str(SGLANG_PYTHON)


def test_the_server_venv_is_complete_and_cpu_only(sglang_python):
    out = subprocess.run([sglang_python, str(ROOT / "sglang_cpu" / "requirements.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_the_server_venv_takes_the_torch_native_path(sglang_python):
    """What SGLang's server imports at startup works there, on the project's stand-in and without AMX."""
    code = ("import json, sgl_kernel, torch, torchvision, torchvision.transforms, torchvision.extension as tv\n"
            "from sglang.srt.utils.common import cpu_has_amx_support\n"
            "from sglang.srt.mem_cache import allocation\n"
            "print(json.dumps({'sgl_kernel': sgl_kernel.__file__, 'amx': cpu_has_amx_support(),\n"
            "  'cuda': torch.version.cuda, 'tv_ops': tv._has_ops(),\n"
            "  'assign': allocation.assign_req_to_token_pool_cpu is sgl_kernel.assign_req_to_token_pool_cpu}))\n")
    out = subprocess.run([sglang_python, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"SGLANG_USE_CPU_ENGINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(got["sgl_kernel"]).resolve() == STANDIN.resolve()
    assert got == {**got, "amx": False, "cuda": None, "tv_ops": False, "assign": True}
