#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron_bapo into it.
#
# On a machine without CUDA, torch is pinned to the CPU build first so that no dependency can pull a
# multi-GB CUDA torch. GPU images (see Dockerfile) bring their own torch, TE and apex instead.
# Idempotent: a second run only re-checks the install (a few seconds).
#
#   bash tools/install.sh                # .venv: what the quick start needs
#   bash tools/install.sh --with-sglang  # also .venv-sglang: the pinned SGLang's request definitions,
#                                        # which tests/test_sglang_conformance.py checks against (the tests)
set -euo pipefail
WITH_SGLANG=0
for arg in "$@"; do
  case "$arg" in
    --with-sglang) WITH_SGLANG=1 ;;
    *) echo "usage: bash tools/install.sh [--with-sglang]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=${VENV:-.venv}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
stamp="$VENV/.megatron_bapo_installed"
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      "${PIP[@]}" install "torch>=2.4"
    else
      echo "[install] torch==$TORCH_CPU_VERSION (CPU build)"
      "${PIP[@]}" install "torch==$TORCH_CPU_VERSION"
    fi
  fi
  echo "[install] megatron_bapo and its dependencies"
  "${PIP[@]}" install -e ".[dev]"
  touch "$stamp"
fi
[ "$WITH_SGLANG" = 1 ] || exit 0

# .venv-sglang: the pinned SGLang's request definitions for tests/test_sglang_conformance.py.
# `sglang` without its dependencies (they are CUDA builds), plus what the modules the check loads
# import: msgspec, pydantic, numpy and the CPU torch from local disk (never a CUDA download).
# shellcheck source=pins.env
source pins.env
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
sstamp="$SGLANG_VENV/.sglang_defs_installed"
if [ -f "$sstamp" ] && [ "$sstamp" -nt pins.env ]; then
  exit 0
fi
if [ ! -x "$SGLANG_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$SGLANG_VENV"
fi
SPIP=("$SGLANG_VENV/bin/python" -m pip --disable-pip-version-check -q)
echo "[install] $SGLANG_VENV: sglang==$SGLANG_VERSION (--no-deps), msgspec, pydantic, torch==$TORCH_CPU_VERSION (CPU)"
"${SPIP[@]}" install "torch==$TORCH_CPU_VERSION" numpy msgspec pydantic
"${SPIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"
touch "$sstamp"
