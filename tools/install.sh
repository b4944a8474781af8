#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron_bapo into it.
#
# On a machine without CUDA, torch is pinned to the CPU build first so that no dependency can pull a
# multi-GB CUDA torch. GPU images (see Dockerfile) bring their own torch, TE and apex instead.
# Idempotent: a second run only re-checks the install (a few seconds).
#
#   bash tools/install.sh                # .venv: what the quick start needs, as requirements.lock pins it
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
# requirements.lock: the resolved package set (refreshed by `bash tools/lock_deps.sh`), installed as pip
# constraints so a fresh clone gets exactly the packages the README's numbers were measured with. It was
# resolved for one Python (its "# python:" line) on a CPU machine: other Pythons install unpinned (a line
# says so); a GPU machine keeps its own torch and pins the rest.
LOCK=requirements.lock
LOCKED=0
CONSTRAINTS=()
venv_py=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ -f "$LOCK" ] && [ "$(sed -n 's/^# python: //p' "$LOCK")" = "$venv_py" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    grep -v '^torch==' "$LOCK" > "$VENV/constraints-gpu.txt"
    CONSTRAINTS=(-c "$VENV/constraints-gpu.txt")
  else
    CONSTRAINTS=(-c "$LOCK")
    LOCKED=1
  fi
elif [ -f "$LOCK" ]; then
  echo "[install] $LOCK was resolved for Python $(sed -n 's/^# python: //p' "$LOCK"), $VENV has $venv_py: installing unpinned (versions may differ from the README's)"
fi
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || { [ -f "$LOCK" ] && [ "$LOCK" -nt "$stamp" ]; }; then
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      "${PIP[@]}" install "torch>=2.4"
    else
      echo "[install] torch==$TORCH_CPU_VERSION (CPU build)"
      "${PIP[@]}" install "torch==$TORCH_CPU_VERSION"
    fi
  fi
  echo "[install] megatron_bapo and its dependencies${CONSTRAINTS:+ (pinned by $LOCK)}"
  "${PIP[@]}" install "${CONSTRAINTS[@]}" -e ".[dev]"
  touch "$stamp"
fi
if [ "$LOCKED" = 1 ] && ! "$VENV/bin/python" tools/check_lock.py --lock "$LOCK" >/dev/null 2>&1; then
  # Something moved a locked package (a manual pip install): put the locked versions back, or refuse.
  echo "[install] $VENV differs from $LOCK: reinstalling the locked versions"
  "${PIP[@]}" install -r "$LOCK"
  "$VENV/bin/python" tools/check_lock.py --lock "$LOCK" >/dev/null || {
    "$VENV/bin/python" tools/check_lock.py --lock "$LOCK"; exit 1; }
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
