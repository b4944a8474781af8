"""Check that the image's pins (pins.env) resolve to one package set, without Docker or a GPU.

    python tools/check_image_pins.py [--report out.json]    # exit 1 with pip's conflict otherwise

The Dockerfile puts SGLang, its router, megatron-core, Transformer Engine and this project into one
environment on NVIDIA's PyTorch container (Python 3.12, x86-64, CUDA 13). This asks pip to resolve
exactly that set for that Python and platform (`pip install --dry-run --report` with
`--python-version/--platform --only-binary=:all:`: pip reads each wheel's metadata from the index,
PEP 658, and downloads no wheel), including the torch SGLang pins (`TORCH_VERSION`). Transformer
Engine's PyTorch extension is a source distribution that the image compiles against that torch
(`NVTE_PYTORCH_FORCE_BUILD=TRUE`); its requirements are read from its sdist's PKG-INFO (half a
megabyte) and resolved with the rest, so its CUDA-major core wheel and torch range must fit too.
tests/test_image_pins.py runs it in CI.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PYTHON = "3.12"
"""NVIDIA's PyTorch container 25.10 runs Python 3.12 (Ubuntu 24.04, glibc 2.39)."""
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
"""Every wheel platform glibc 2.39 accepts: pip does not widen one manylinux tag to the older ones."""
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def read_pins(path: Path = ROOT / "pins.env") -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            pins[key.strip()] = value.strip()
    return pins


def sdist_requirements(project: str, version: str) -> list[str]:
    """`Requires-Dist` of a source distribution's PKG-INFO (read from the index, never built)."""
    request = urllib.request.Request(f"{INDEX}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        files = json.load(reply)["files"]
    [url] = [f["url"] for f in files if f["filename"] == f"{project.replace('-', '_')}-{version}.tar.gz"]
    with urllib.request.urlopen(url, timeout=120) as reply:
        data = reply.read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        text = tar.extractfile(member).read().decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def project_requirements() -> list[str]:
    """What `pip install './[dev]'` in the Dockerfile asks for besides the pins (setup.py's lists)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    out = []
    for spec in metadata.requires("megatron_bapo") or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": "dev"}):
            req.marker = None
            out.append(str(req))
    return out


def image_requirements(pins: dict[str, str]) -> list[str]:
    te = pins["TRANSFORMER_ENGINE_VERSION"]
    return [f"sglang=={pins['SGLANG_VERSION']}", f"sglang-router=={pins['SGLANG_ROUTER_VERSION']}",
            f"torch=={pins['TORCH_VERSION']}", f"megatron-core=={pins['MEGATRON_CORE_VERSION']}",
            f"transformer-engine=={te}", f"transformer-engine-{pins['TRANSFORMER_ENGINE_CUDA']}=={te}",
            *sdist_requirements("transformer-engine-torch", te), *project_requirements()]


def resolve(requirements: list[str], report: Path) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
               "--report", str(report), "--target", target, "--python-version", IMAGE_PYTHON,
               "--implementation", "cp", "--only-binary=:all:", *[f"--platform={p}" for p in PLATFORMS],
               *requirements]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=1800)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="keep pip's resolution report here")
    args = parser.parse_args()
    pins = read_pins()
    requirements = image_requirements(pins)
    report = args.report or Path(tempfile.mkdtemp()) / "report.json"
    done = resolve(requirements, report)
    if done.returncode != 0:
        errors = [ln for ln in done.stderr.splitlines() if not ln.startswith("WARNING: Location")]
        print(f"the image's pins do not resolve together for Python {IMAGE_PYTHON} on x86-64:\n" + "\n".join(errors[-30:]),
              file=sys.stderr)
        return 1
    installed = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
                 for i in json.loads(report.read_text())["install"]}
    shown = ("torch", "sglang", "sglang-router", "megatron-core", "transformer-engine",
             f"transformer-engine-{pins['TRANSFORMER_ENGINE_CUDA']}", "nvidia-nccl-cu13", "nvidia-nccl-cu12",
             "transformers", "flashinfer-python")
    print(f"one set of {len(installed)} packages for Python {IMAGE_PYTHON} x86-64: "
          + ", ".join(f"{name} {installed[name]}" for name in shown if name in installed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
