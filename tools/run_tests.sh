#!/usr/bin/env bash
# The project's test command (README quick start, and what CI runs): install if needed, then pytest.
# The test files run on TEST_WORKERS pytest-xdist workers (default 2: the suite waits on servers and
# processes as much as it computes), one file per worker at a time (`--dist loadfile`: a module's
# servers and fixtures stay in one process). TEST_WORKERS=0 runs everything in this one process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/install.sh --with-sglang
WORKERS=${TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
