#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron_bapo into it.
#
# On a machine without CUDA, torch is pinned to the CPU build first so that no dependency can pull a
# multi-GB CUDA torch. GPU images (see Dockerfile) bring their own torch, TE and apex instead.
# Idempotent: a second run only re-checks the install (a few seconds).
#
#   bash tools/install.sh                # .venv: what the quick start needs, as requirements.lock pins it
#   bash tools/install.sh --with-sglang  # also .venv-sglang: the real SGLang server (pins.env's version) on
#                                        # CPU, what rollout.engine=sglang runs and the test suite's live tier
#                                        # and conformance check use (sglang_cpu/README.md; ~3.4 GB, minutes)
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

# ---------------------------------------------------------------------------------------------------------
# .venv-sglang: the real SGLang server (`python -m sglang.launch_server --device cpu`) at pins.env's version,
# on the CPU torch. One venv serves rollout.engine=sglang, the live contract tests and the conformance check
# (tools/sglang_conformance.py reads SGLang's own definitions from it). What goes in, and why
# (sglang_cpu/README.md): sglang_cpu/requirements.txt, SGLang's Requires-Dist minus the CUDA-only ones,
# resolved once and frozen, installed with --no-deps after the CPU torch from local disk (so nothing can pull
# a CUDA torch); torchvision made importable beside the CPU torch (sglang_cpu/torchvision_cpu.py); the
# project's pure-torch sgl_kernel stand-in on the path (a .pth file naming sglang_cpu/site).
install_sglang_server() {
  # shellcheck source=pins.env
  source pins.env
  local venv=${SGLANG_VENV:-.venv-sglang} lock=sglang_cpu/requirements.txt
  local stamp="$venv/.sglang_server_installed"
  if [ -f "$stamp" ] && [ "$stamp" -nt pins.env ] && [ "$stamp" -nt "$lock" ] \
     && [ "$stamp" -nt sglang_cpu/torchvision_cpu.py ]; then
    return 0
  fi
  local locked
  locked=$(sed -n 's/^sglang==//p' "$lock")
  if [ "$locked" != "$SGLANG_VERSION" ]; then
    echo "[install] $lock is for sglang==$locked but pins.env says $SGLANG_VERSION: regenerate it" \
         "(sglang_cpu/README.md)" >&2
    exit 2
  fi
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  local spip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  echo "[install] $venv: sglang==$SGLANG_VERSION on torch==$TORCH_CPU_VERSION (CPU) from $lock (a few minutes)"
  "${spip[@]}" install "torch==$TORCH_CPU_VERSION"
  "${spip[@]}" install --no-deps -r "$lock"
  "$venv/bin/python" sglang_cpu/torchvision_cpu.py
  local site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$PWD/sglang_cpu/site" > "$site/megatron_bapo_sglang_cpu.pth"
  "$venv/bin/python" sglang_cpu/requirements.py --check --torch-version "$TORCH_CPU_VERSION"
  touch "$stamp"
}
install_sglang_server
