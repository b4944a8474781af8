#!/usr/bin/env bash
# One command that checks the CUDA path on one GPU, unchanged from its first run:
#   1. the gpu-marked tests (pytest -m gpu: TE / NCCL actor steps, the GPU recipe runs, ...);
#   2. benchmarks/gpu_bench.py: bf16 BAPO steps of random Qwen2.5-0.5B- and 1.5B-shaped models with
#      packed micro-batches in a one-rank NCCL world (tokens/s, MFU against the stated peak, peak
#      memory, share of the step in the search pass, forward/backward and optimizer); chunked vs naive
#      log-probs + entropy at 32k and 64k tokens x 152k vocabulary; the bound search over 2M tokens
#      vs the per-step loop and one loss evaluation.
# Everything is printed and kept in OUT_DIR (tests.log, bench.log, gpu_bench.json).
#
#   bash tools/gpu_check.sh [--out DIR] [--skip-tests] [--skip-bench] [--tiny] [-- gpu_bench.py args]
#   bash tools/gpu_check.sh --fetch-wheels     # where pip reaches PyPI: wheels for an image without network
#
# The machine needs python3 with a CUDA torch; nothing is installed into it. Python packages it
# lacks (megatron-core above all) are carried as wheels in .whl/ (GPU_CHECK_WHEELS), which
# --fetch-wheels fills for Python 3.12 on x86-64 (PY_VERSION to change; the megatron-core version is
# pins.env's); they are unpacked into a
# temporary directory on PYTHONPATH. Without Transformer Engine the local layer spec runs: the
# first line and the summary line say so (and why), and OUT_DIR/layer_spec.txt keeps it. --tiny
# shrinks every benchmark to CPU size (the tests run this whole script on a CPU that way). Exit status: 0 when every part passed, else the first failure's.
# Where one command has a time limit, run the parts in two calls: --skip-bench, then --skip-tests.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

PYTHON=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
OUT_DIR=${OUT:-${TMPDIR:-/tmp}}/gpu_check
RUN_TESTS=1
RUN_BENCH=1
BENCH_ARGS=()

fetch_wheels() {
  local version=${MEGATRON_CORE_VERSION:-$(sed -n 's/^MEGATRON_CORE_VERSION=//p' pins.env 2>/dev/null)}
  version=${version:-0.16.1}
  local plats=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    plats+=(--platform "$p")
  done
  mkdir -p "$WHEELS"
  if git rev-parse --git-dir >/dev/null 2>&1 && ! grep -qx "/$WHEELS/" "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null; then
    echo "/$WHEELS/" >>"$(git rev-parse --git-dir)/info/exclude"
  fi
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
    --implementation cp "${plats[@]}" -d "$WHEELS" "megatron-core==$version"
  ls -l "$WHEELS"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --fetch-wheels) fetch_wheels; exit $? ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --skip-tests) RUN_TESTS=0; shift ;;
    --skip-bench) RUN_BENCH=0; shift ;;
    --tiny) BENCH_ARGS+=(--tiny); shift ;;
    --) shift; BENCH_ARGS+=("$@"); break ;;
    *) echo "gpu_check: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
carried=("$WHEELS"/*.whl)
if [ ${#carried[@]} -gt 0 ]; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${carried[@]}" || exit 2
  export PYTHONPATH="$site:$PYTHONPATH"
fi
if ! "$PYTHON" -c "import torch, megatron.core" 2>"$OUT_DIR/import.err"; then
  echo "gpu_check: $PYTHON cannot import torch and megatron.core ($(tail -1 "$OUT_DIR/import.err"));" \
       "run 'bash tools/gpu_check.sh --fetch-wheels' where pip works and carry $WHEELS/" >&2
  exit 2
fi
# The layer spec every part runs, first and last in the output: a run without Transformer Engine
# measures megatron-core's local spec (torch SDPA, unfused norms and MLPs), not the TE path.
spec=$("$PYTHON" -c 'from megatron_bapo.models.layer_spec import resolve_layer_spec as r; s = r("auto")
print(("transformer_engine (" if s.use_te else "local, NOT Transformer Engine (") + s.reason + ")")' 2>"$OUT_DIR/spec.err") ||
  spec="unresolved: $(tail -1 "$OUT_DIR/spec.err")"
case "$spec" in
  transformer_engine*) echo "gpu_check: layer spec $spec" ;;
  unresolved*) echo "gpu_check: !!! layer spec $spec: an actor with layer_spec=auto refuses to build here !!!" ;;
  *) echo "gpu_check: !!! layer spec $spec: every number below is the local spec, not the TE path !!!" ;;
esac
echo "$spec" >"$OUT_DIR/layer_spec.txt"
if [ ${#carried[@]} -gt 0 ]; then
  echo "gpu_check: carried wheels on PYTHONPATH: $(basename -a "${carried[@]}" | tr '\n' ' ')"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

status=0
if [ "$RUN_TESTS" = 1 ]; then
  # Only the files that hold gpu-marked tests: a module importing something this image lacks must
  # not stop the collection of the others.
  mapfile -t gpu_files < <(grep -l "mark\.gpu" tests/test_*.py)
  echo "== gpu-marked tests (${gpu_files[*]})"
  "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider "${gpu_files[@]}" 2>&1 | tee "$OUT_DIR/tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 5 ] && rc=0  # pytest's "no tests collected" (none selected on this machine) is not a failure
  echo "gpu_check: gpu-marked tests exit status $rc"
  [ "$status" = 0 ] && status=$rc
fi
if [ "$RUN_BENCH" = 1 ]; then
  echo "== benchmarks (benchmarks/gpu_bench.py)"
  "$PYTHON" benchmarks/gpu_bench.py --out "$OUT_DIR" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT_DIR/bench.log"
  rc=${PIPESTATUS[0]}
  echo "gpu_check: benchmarks exit status $rc"
  [ "$status" = 0 ] && status=$rc
fi
echo "gpu_check: done (status $status, layer spec $spec); outputs in $OUT_DIR"
exit "$status"
