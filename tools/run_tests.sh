#!/usr/bin/env bash
# The project's test command (README quick start, and what CI runs): install if needed, then pytest.
# Test files run on TEST_WORKERS (default 2) pytest-xdist workers, one file per worker at a time
# (`--dist loadfile`: a module's servers and fixtures stay in one process); most files wait on
# servers and subprocesses more than they compute. TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/install.sh --with-sglang
WORKERS=${TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
