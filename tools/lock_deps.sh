#!/usr/bin/env bash
# Refresh requirements.lock: the exact package set a fresh .venv resolves, which tools/install.sh then
# installs everywhere (a fresh clone gets the same packages, so it reproduces the README's numbers).
#
#   bash tools/lock_deps.sh        # resolves in a throw-away venv (Python 3.11, CPU torch from local disk)
#
# Commit the new requirements.lock with the change that needed it (a new dependency, a deliberate upgrade),
# and re-measure the README's quick-start numbers with it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3.11}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
PIP=("$work/venv/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "torch==$TORCH_CPU_VERSION"
"${PIP[@]}" install ".[dev]"
{
  echo "# The package set of .venv, resolved by \`bash tools/lock_deps.sh\` on $("$work/venv/bin/python" --version)"
  echo "# (CPU torch $TORCH_CPU_VERSION); tools/install.sh installs exactly these (pip constraints) and checks them."
  echo "# python: $("$work/venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  # the project itself is not pinned; torch's local label (+cpu) is dropped: ==2.13.0 matches the wheel on disk
  "$work/venv/bin/python" -m pip freeze --exclude megatron_bapo | sed -E 's/^(torch==[^+]*)\+.*/\1/' | LC_ALL=C sort -f
} > requirements.lock.tmp
mv requirements.lock.tmp requirements.lock
echo "[lock] requirements.lock: $(grep -vc '^#' requirements.lock) packages"
