#!/usr/bin/env bash
# The project's test command (README quick start, and what CI runs): install if needed, then pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/install.sh --with-sglang
exec .venv/bin/python -m pytest -q "$@"
