"""What the real SGLang server needs on a CPU-only machine, computed from SGLang's own wheel metadata.

    .venv-sglang/bin/python sglang_cpu/requirements.py --print     # the list, from the installed sglang
    .venv-sglang/bin/python sglang_cpu/requirements.py --freeze    # rewrite sglang_cpu/requirements.txt
    .venv-sglang/bin/python sglang_cpu/requirements.py --check     # this venv satisfies it (the test)

SGLang's `Requires-Dist` names CUDA builds (kernels, a CUDA torch, the CUDA runtime). On a machine
without CUDA the server runs on SGLang's torch-native path, so the list is SGLang's own requirements
(no extras, markers evaluated here) minus the CUDA-only ones below, with torch pinned to the CPU build
(`TORCH_CPU_VERSION`, a file on local disk; SGLang 0.5.23 pins torch 2.14.1, whose PyPI wheels are
CUDA builds). `tools/install.sh --with-sglang` installs `requirements.txt` (this list resolved once and
frozen, so every install gets the same versions) with `--no-deps`; `--check` is what
`tests/test_sglang_cpu.py` runs in the built venv.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
LOCK = HERE / "requirements.txt"
PINS = HERE.parent / "pins.env"

CUDA_ONLY = {
    "sglang-kernel": "SGLang's CUDA kernels; the CPU build is not on PyPI (sglang_cpu/site/sgl_kernel stands in)",
    "cuda-python": "CUDA driver bindings",
    "nvshmem4py-cu13": "NVSHMEM (multi-GPU communication)",
    "quack-kernels": "CUDA kernels (CuTe DSL)",
    "tilelang": "GPU kernel compiler",
    "humming-kernels": "CUDA quantized GEMM kernels",
    "sgl-deep-ep": "expert-parallel all-to-all over NVSHMEM",
    "sgl-deep-gemm": "FP8 GEMM CUDA kernels",
    "sgl-flash-mla": "MLA attention CUDA kernels",
    "torch-memory-saver": "CUDA memory release/resume",
    "torchaudio": "a CUDA build of torch's audio package (pins torch 2.14.1); audio models only",
    "torchcodec": "video decoding against a CUDA torch; video models only",
    "deepseek-recipe": "DeepSeek CUDA recipes",
    "tml-renderers": "GPU renderers for multimodal inputs",
}
"""Requirements a CPU server does without, and why (names as `canonicalize_name` spells them)."""
CUDA_ONLY_PREFIXES = {
    "flashinfer": "FlashInfer's CUDA attention/sampling kernels",
    "flash-attn": "FlashAttention CUDA kernels",
    "nvidia-": "CUDA runtime and libraries (nvidia-ml-py, a pure-Python NVML binding, is kept)",
}
KEEP = {"nvidia-ml-py"}


def is_cuda_only(name: str) -> bool:
    name = canonicalize_name(name)
    if name in KEEP:
        return False
    return name in CUDA_ONLY or any(name.startswith(p) for p in CUDA_ONLY_PREFIXES)


def pins() -> dict[str, str]:
    lines = PINS.read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))


def cpu_requirements(requires: list[str], *, torch_version: str, environment: dict | None = None) -> list[str]:
    """SGLang's `Requires-Dist` lines as a CPU install needs them: no extras, markers evaluated for
    `environment` (this interpreter by default), CUDA-only names dropped, torch pinned to
    `torch_version`. Returns requirement strings, sorted by name."""
    env = dict(environment or default_environment())
    env.setdefault("extra", "")
    out = {}
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if is_cuda_only(name):
            continue
        if name == "torch":
            out[name] = f"torch=={torch_version}"
            continue
        req.marker = None
        out[name] = str(req)
    return [out[k] for k in sorted(out)]


def installed_requirements() -> list[str]:
    requires = md.requires("sglang")
    if requires is None:
        raise SystemExit("sglang is not installed in this environment")
    return list(requires)


def freeze(torch_version: str) -> str:
    """requirements.txt for this venv: every installed distribution at its version (pip's own
    packages and the torch build tag dropped), under a header naming what it was resolved for."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout.splitlines()
    lines = []
    for line in out:
        name = canonicalize_name(line.split("==")[0])
        if name in {"pip", "setuptools", "wheel"}:
            continue
        if name == "torch":
            line = f"torch=={torch_version}"
        lines.append(line)
    header = [
        f"# The real SGLang server on CPU: sglang=={md.version('sglang')} and what it needs, resolved once, frozen.",
        "# Installed with --no-deps by tools/install.sh --with-sglang; regenerate with",
        "#   .venv-sglang/bin/python sglang_cpu/requirements.py --freeze",
        "# after installing sglang_cpu/requirements.py --print's list (see sglang_cpu/README.md).",
        f"# torch is the CPU build on local disk ({torch_version}); torchvision is the PyPI build for it,",
        "# made CPU-safe by sglang_cpu/torchvision_cpu.py.",
    ]
    return "\n".join(header + sorted(lines, key=str.lower)) + "\n"


def check(torch_version: str) -> list[str]:
    """Problems with this venv as a CPU SGLang server: sglang not at pins.env's version, a CPU
    requirement missing or unsatisfied, a CUDA-only distribution present, a non-CPU torch."""
    problems = []
    want = pins()["SGLANG_VERSION"]
    if md.version("sglang") != want:
        problems.append(f"sglang {md.version('sglang')} installed, pins.env says {want}")
    for line in cpu_requirements(installed_requirements(), torch_version=torch_version):
        req = Requirement(line)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{line}: not installed")
            continue
        if req.name == "torch":
            if have.split("+")[0] != torch_version or "+cpu" not in have:
                problems.append(f"torch {have} installed, want the CPU build {torch_version}+cpu")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{line}: {have} installed")
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and is_cuda_only(name):
            problems.append(f"{name} {dist.version} is installed but is CUDA-only")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--print", action="store_true", help="SGLang's requirements for a CPU install, one a line")
    mode.add_argument("--freeze", action="store_true", help=f"rewrite {LOCK.name} from this venv")
    mode.add_argument("--check", action="store_true", help="this venv is a complete CPU SGLang install")
    ap.add_argument("--torch-version", default="2.13.0")
    args = ap.parse_args(argv)
    if args.print:
        print("\n".join(cpu_requirements(installed_requirements(), torch_version=args.torch_version)))
    elif args.freeze:
        LOCK.write_text(freeze(args.torch_version))
        print(f"wrote {LOCK}")
    else:
        problems = check(args.torch_version)
        for p in problems:
            print(p)
        if problems:
            return 1
        print(f"ok: sglang {md.version('sglang')} with torch {md.version('torch')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
