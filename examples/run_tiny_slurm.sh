#!/usr/bin/env bash
#SBATCH --job-name=bapo-tiny
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --time=01:00:00
#SBATCH --output=bapo-tiny-%j.out
#
# The tiny BAPO run (examples/configs/tiny_bapo.yaml) launched the way examples/run_32b_bapo.sh
# launches the 32B one, on a single machine: the built-in rollout server (SGLang's HTTP API) is
# one SLURM job step, the Megatron actor (CPU, gloo) another; both are stopped by PID at the end.
#
#   sbatch examples/run_tiny_slurm.sh [section.key=value ...]
#   DRY_RUN=1 bash examples/run_tiny_slurm.sh
#
# Environment (default):
#   REPO_DIR        this checkout ($SLURM_SUBMIT_DIR)
#   PYTHON          interpreter with megatron_bapo installed ($REPO_DIR/.venv/bin/python)
#   CONFIG          run YAML ($REPO_DIR/examples/configs/tiny_bapo.yaml)
#   TINY_DIR        tiny task assets, built by tools/make_tiny.py when missing ($REPO_DIR/runs/tiny_assets)
#   OUTPUT_DIR      run directory: checkpoints, TensorBoard (tb/), logs ($REPO_DIR/runs/tiny_slurm)
#   LOG_DIR         job step logs ($OUTPUT_DIR/logs/slurm-$SLURM_JOB_ID)
#   SERVER_PORT     built-in server port; 0 = a free port picked by the server (0)
#   SYNC_METHOD     weight sync: "disk" (HF dir + /update_weights_from_disk) or "distributed" (gloo
#                   process group + /update_weights_from_distributed, as the 32B run does with NCCL) (disk)
#   SYNC_PORT       port of the distributed weight-sync group on this machine (0: rank 0 binds a free one)
#   ACTOR_PROCS     actor ranks (1; >1 runs torchrun --standalone with gloo)
#   HEALTH_TIMEOUT  seconds to wait for the server (300)
#   CLEANUP_TIMEOUT seconds between SIGTERM and SIGKILL at cleanup (30)
#   DRY_RUN         1 = print the commands only
set -euo pipefail

REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
# shellcheck source=examples/slurm_common.sh
source "$REPO_DIR/examples/slurm_common.sh"
cd "$REPO_DIR"

PYTHON=${PYTHON:-$REPO_DIR/.venv/bin/python}
CONFIG=${CONFIG:-$REPO_DIR/examples/configs/tiny_bapo.yaml}
TINY_DIR=${TINY_DIR:-$REPO_DIR/runs/tiny_assets}
OUTPUT_DIR=${OUTPUT_DIR:-$REPO_DIR/runs/tiny_slurm}
LOG_DIR=${LOG_DIR:-$OUTPUT_DIR/logs/slurm-${SLURM_JOB_ID:-local}}
SERVER_PORT=${SERVER_PORT:-0}
ACTOR_PROCS=${ACTOR_PROCS:-1}
SYNC_METHOD=${SYNC_METHOD:-disk}
SYNC_PORT=${SYNC_PORT:-0}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-300}
export CLEANUP_TIMEOUT=${CLEANUP_TIMEOUT:-30}

is_dry_run || mkdir -p "$LOG_DIR"
install_cleanup_trap

# 0. The tiny model and data (built once, as a job step).
if [ ! -f "$TINY_DIR/info.json" ]; then
  run_cmd srun --overlap --ntasks=1 "$PYTHON" tools/make_tiny.py --out "$TINY_DIR" --force
fi

# 1. The built-in rollout server as a job step, with the flags the weight sync relies on.
sync_server_flags "$CONFIG" "$@"
PORT_FILE=$LOG_DIR/server.port
is_dry_run || rm -f "$PORT_FILE"
start_bg server srun --overlap --ntasks=1 \
  "$PYTHON" -m megatron_bapo.server --model-path "$TINY_DIR/base_model" --host 127.0.0.1 \
  --port "$SERVER_PORT" --port-file "$PORT_FILE" "${SYNC_FLAGS[@]}"
SERVER_PID=$BG_PID
if is_dry_run; then
  SERVER_URL="http://127.0.0.1:PORT"
else
  deadline=$((SECONDS + HEALTH_TIMEOUT))
  until [ -s "$PORT_FILE" ]; do
    kill -0 "$SERVER_PID" 2>/dev/null || die "the server step exited; see $LOG_DIR/server.log"
    [ "$SECONDS" -ge "$deadline" ] && die "the server wrote no port file within ${HEALTH_TIMEOUT}s"
    sleep 1
  done
  SERVER_URL="http://127.0.0.1:$(cat "$PORT_FILE")"
fi
wait_for_health "$HEALTH_TIMEOUT" "$SERVER_PID" "$SERVER_URL"

# 2. The actor as a job step (one process, or torchrun with ACTOR_PROCS gloo ranks).
SYNC_ARGS=(sync.method="$SYNC_METHOD")
if [ "$SYNC_METHOD" = distributed ]; then
  SYNC_ARGS+=(sync.backend=gloo sync.master_address=127.0.0.1 sync.master_port="$SYNC_PORT")
fi
LAUNCH=("$PYTHON")
if [ "$ACTOR_PROCS" -gt 1 ]; then
  LAUNCH=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$ACTOR_PROCS")
fi
start_bg actor srun --overlap --ntasks=1 \
  "${LAUNCH[@]}" -m megatron_bapo.train --config "$CONFIG" \
  model.hf_path="$TINY_DIR/base_model" data.path="$TINY_DIR/data/train.jsonl" \
  "eval.datasets=[{name: tiny_test, path: $TINY_DIR/data/test.jsonl}]" \
  trainer.output_dir="$OUTPUT_DIR" "rollout.client.urls=$(yaml_list "$SERVER_URL")" trainer.progress=false \
  "${SYNC_ARGS[@]}" "$@"
ACTOR_PID=$BG_PID

status=0
wait_bg "$ACTOR_PID" || status=$?
log "actor exited with status $status"
exit "$status"
