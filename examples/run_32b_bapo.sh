#!/usr/bin/env bash
#SBATCH --job-name=bapo-32b-64k
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=bapo-32b-%j.out
#
# BAPO on a 32B policy with 64k responses (partial rollouts) on a SLURM cluster; RECIPE picks the model.
#
#   sbatch examples/run_32b_bapo.sh [section.key=value ...]        (overrides go to the trainer)
#   RECIPE=qwen3-32b sbatch examples/run_32b_bapo.sh                (Qwen3-32B, 64k responses)
#   RECIPE=qwen3-8b sbatch --nodes=2 examples/run_32b_bapo.sh       (Qwen3-8B: 1 actor + 1 rollout node)
#   RECIPE=qwen3-30b-a3b sbatch --nodes=3 examples/run_32b_bapo.sh  (Qwen3-30B-A3B MoE: 2 actor + 1 rollout node)
#   DRY_RUN=1 bash examples/run_32b_bapo.sh                         (print every command, run nothing)
#
# Layout (the first ACTOR_NODES nodes train, the rest serve rollouts):
#   - rollout nodes: one SGLang server per ROLLOUT_TP GPUs (`python -m sglang.launch_server`, one
#     `srun` job step each), plus `sglang-router` on the first rollout node in front of them; the
#     servers get the flags the weight sync relies on (read from the run config: see
#     `sync_server_flags` in slurm_common.sh), which DRY_RUN shows;
#   - the script waits for every server's and the router's /health;
#   - actor nodes: one `srun` step, one `torchrun` per node (GPUS_PER_NODE ranks each) running
#     `python -m megatron_bapo.train` with the weight sync over NCCL (sync.method=distributed:
#     trainer rank 0 + every SGLang TP rank form one process group);
#   - on exit, failure or scancel, the steps started here are stopped by PID (never by name).
# Check the layout first: python tools/plan.py --config "$CONFIG" --hf-config "$MODEL_DIR" --gpus 64
#
# Environment (default):
#   RECIPE            qwen2.5-32b | qwen3-32b | qwen3-8b | qwen3-30b-a3b: the defaults of CONFIG, MODEL_DIR,
#                     OUTPUT_DIR and, for qwen3-8b, ACTOR_NODES=1 ROLLOUT_NODES=1 ROLLOUT_TP=1
#                     CONTEXT_LENGTH=36864; for qwen3-30b-a3b, ACTOR_NODES=2 ROLLOUT_NODES=1 ROLLOUT_TP=2
#                     CONTEXT_LENGTH=36864
#                     (qwen2.5-32b); every variable below set explicitly wins over the recipe's default
#   REPO_DIR          checkout of this project on the shared file system ($SLURM_SUBMIT_DIR)
#   CONFIG            run YAML ($REPO_DIR/examples/configs/<recipe>.yaml)
#   MODEL_DIR         HF checkpoint of the initial policy (/models/Qwen2.5-32B, /models/Qwen3-32B, ...)
#   DATA_PATH         prompt file, jsonl or parquet (/data/skywork-or1-rl.parquet)
#   OUTPUT_DIR        checkpoints, TensorBoard, logs (/checkpoints/bapo-32b-64k)
#   LOG_DIR           per-step logs ($OUTPUT_DIR/logs/$SLURM_JOB_ID)
#   ACTOR_NODES       nodes for the Megatron actor (8; tp*pp*cp must divide ACTOR_NODES*GPUS_PER_NODE)
#   ROLLOUT_NODES     nodes for SGLang (8); ACTOR_NODES + ROLLOUT_NODES = the job's node count
#   GPUS_PER_NODE     GPUs per node (8)
#   ROLLOUT_TP        GPUs per SGLang server (8; must divide GPUS_PER_NODE)
#   SERVER_PORT       first SGLang port on a node; server i uses SERVER_PORT+i (30000)
#   ROUTER_PORT       sglang-router port (29000)
#   MASTER_PORT       torchrun rendezvous port on the first actor node (29500)
#   SYNC_PORT         weight-sync process group port on the first actor node (29600)
#   CONTEXT_LENGTH    SGLang context length (69632: 2k prompt + 64k response + margin)
#   MEM_FRACTION      SGLang --mem-fraction-static (0.85)
#   SERVER_ARGS       extra arguments for sglang.launch_server ("")
#   ROUTER_ARGS       extra arguments for sglang_router.launch_router ("--policy cache_aware")
#   PYTHON            python of the actor inside the job (python)
#   SGLANG_PYTHON     python with sglang and sglang-router ($PYTHON; the Dockerfile's /opt/venv has both sides)
#   CONTAINER_IMAGE   if set, every srun runs in this image (pyxis; see Dockerfile); CONTAINER_MOUNTS too
#   HEALTH_TIMEOUT    seconds to wait for servers and router (1800)
#   CLEANUP_TIMEOUT   seconds between SIGTERM and SIGKILL at cleanup (60)
#   DRY_RUN           1 = print the commands only (NUM_NODES placeholder nodes outside SLURM)
set -euo pipefail

REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
# shellcheck source=examples/slurm_common.sh
source "$REPO_DIR/examples/slurm_common.sh"

RECIPE=${RECIPE:-qwen2.5-32b}
case "$RECIPE" in
  qwen2.5-32b)
    : "${CONFIG:=$REPO_DIR/examples/configs/qwen2.5-32b-bapo-64k.yaml}" "${MODEL_DIR:=/models/Qwen2.5-32B}"
    : "${OUTPUT_DIR:=/checkpoints/bapo-32b-64k}" ;;
  qwen3-32b)
    : "${CONFIG:=$REPO_DIR/examples/configs/qwen3-32b-bapo-64k.yaml}" "${MODEL_DIR:=/models/Qwen3-32B}"
    : "${OUTPUT_DIR:=/checkpoints/bapo-qwen3-32b-64k}"
    # 64k responses run past Qwen3's max_position_embeddings (40960); SGLang refuses a longer
    # --context-length unless told to accept it (the trainer uses the same plain RoPE: docs/cluster.md).
    export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=${SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN:-1} ;;
  qwen3-8b)
    : "${CONFIG:=$REPO_DIR/examples/configs/qwen3-8b-bapo.yaml}" "${MODEL_DIR:=/models/Qwen3-8B}"
    : "${OUTPUT_DIR:=/checkpoints/bapo-qwen3-8b}" "${ACTOR_NODES:=1}" "${ROLLOUT_NODES:=1}" "${ROLLOUT_TP:=1}"
    : "${CONTEXT_LENGTH:=36864}" ;;  # 2k prompt + 32k response + margin, within max_position_embeddings
  qwen3-30b-a3b)
    : "${CONFIG:=$REPO_DIR/examples/configs/qwen3-30b-a3b-bapo.yaml}" "${MODEL_DIR:=/models/Qwen3-30B-A3B}"
    : "${OUTPUT_DIR:=/checkpoints/bapo-qwen3-30b-a3b}" "${ACTOR_NODES:=2}" "${ROLLOUT_NODES:=1}" "${ROLLOUT_TP:=2}"
    : "${CONTEXT_LENGTH:=36864}" ;;  # the config turns on routing replay: servers get --enable-return-routed-experts
  *) die "RECIPE=$RECIPE is not one of: qwen2.5-32b qwen3-32b qwen3-8b qwen3-30b-a3b" ;;
esac
DATA_PATH=${DATA_PATH:-/data/skywork-or1-rl.parquet}
LOG_DIR=${LOG_DIR:-$OUTPUT_DIR/logs/${SLURM_JOB_ID:-local}}
ACTOR_NODES=${ACTOR_NODES:-8}
ROLLOUT_NODES=${ROLLOUT_NODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ROLLOUT_TP=${ROLLOUT_TP:-8}
SERVER_PORT=${SERVER_PORT:-30000}
ROUTER_PORT=${ROUTER_PORT:-29000}
MASTER_PORT=${MASTER_PORT:-29500}
SYNC_PORT=${SYNC_PORT:-29600}
CONTEXT_LENGTH=${CONTEXT_LENGTH:-69632}
MEM_FRACTION=${MEM_FRACTION:-0.85}
SERVER_ARGS=${SERVER_ARGS:-}
ROUTER_ARGS=${ROUTER_ARGS:---policy cache_aware}
PYTHON=${PYTHON:-python}
SGLANG_PYTHON=${SGLANG_PYTHON:-$PYTHON}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-1800}
NUM_NODES=$((ACTOR_NODES + ROLLOUT_NODES))
export CLEANUP_TIMEOUT=${CLEANUP_TIMEOUT:-60}

[ $((GPUS_PER_NODE % ROLLOUT_TP)) -eq 0 ] || die "ROLLOUT_TP=$ROLLOUT_TP must divide GPUS_PER_NODE=$GPUS_PER_NODE"
mapfile -t ALL_NODES < <(job_nodes)
[ "${#ALL_NODES[@]}" -eq "$NUM_NODES" ] ||
  die "the job has ${#ALL_NODES[@]} nodes but ACTOR_NODES + ROLLOUT_NODES = $NUM_NODES"
ACTOR=("${ALL_NODES[@]:0:ACTOR_NODES}")
ROLLOUT=("${ALL_NODES[@]:ACTOR_NODES}")
MASTER_ADDR=${ACTOR[0]}
ROUTER_HOST=${ROLLOUT[0]}
mapfile -t SRUN < <(srun_prefix)
read -r -a SERVER_EXTRA <<<"$SERVER_ARGS"
read -r -a ROUTER_EXTRA <<<"$ROUTER_ARGS"

is_dry_run || mkdir -p "$LOG_DIR"
install_cleanup_trap
log "recipe $RECIPE: config $CONFIG, model $MODEL_DIR${SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN:+, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=$SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN}"
log "actor nodes: ${ACTOR[*]}; rollout nodes: ${ROLLOUT[*]}; logs in $LOG_DIR"
sync_server_flags "$CONFIG" "$@"
log "server flags the weight sync relies on: ${SYNC_FLAGS[*]}"

# 1. SGLang servers: one per ROLLOUT_TP GPUs of every rollout node.
WORKER_URLS=()
SERVER_PIDS=()
for node in "${ROLLOUT[@]}"; do
  for ((i = 0; i < GPUS_PER_NODE / ROLLOUT_TP; i++)); do
    port=$((SERVER_PORT + i))
    start_bg "sglang_${node}_${i}" "${SRUN[@]}" --nodes=1 --ntasks=1 --nodelist="$node" \
      --gpus="$ROLLOUT_TP" --exact --kill-on-bad-exit=1 \
      "$SGLANG_PYTHON" -m sglang.launch_server --model-path "$MODEL_DIR" --tp-size "$ROLLOUT_TP" \
      --host 0.0.0.0 --port "$port" --context-length "$CONTEXT_LENGTH" \
      --mem-fraction-static "$MEM_FRACTION" --trust-remote-code "${SYNC_FLAGS[@]}" "${SERVER_EXTRA[@]}"
    SERVER_PIDS+=("$BG_PID")
    WORKER_URLS+=("http://$node:$port")
  done
done

# 2. sglang-router in front of them (generation only; weight updates go to every server).
start_bg router "${SRUN[@]}" --overlap --nodes=1 --ntasks=1 --nodelist="$ROUTER_HOST" \
  "$SGLANG_PYTHON" -m sglang_router.launch_router --host 0.0.0.0 --port "$ROUTER_PORT" \
  --worker-urls "${WORKER_URLS[@]}" "${ROUTER_EXTRA[@]}"
ROUTER_PID=$BG_PID
ROUTER_URL="http://$ROUTER_HOST:$ROUTER_PORT"

# 3. Wait until every server and the router answer /health.
for ((i = 0; i < ${#WORKER_URLS[@]}; i++)); do
  wait_for_health "$HEALTH_TIMEOUT" "${SERVER_PIDS[$i]}" "${WORKER_URLS[$i]}"
done
wait_for_health "$HEALTH_TIMEOUT" "$ROUTER_PID" "$ROUTER_URL"

# 4. The Megatron actor: one torchrun per actor node; PET_NODE_RANK is torchrun's --node-rank.
# shellcheck disable=SC2016  # $SLURM_PROCID must expand in each task, not here
NODE_RANK_WRAPPER='export PET_NODE_RANK=$SLURM_PROCID; exec "$@"'
ACTOR_NODELIST=$(yaml_list "${ACTOR[@]}")
start_bg actor "${SRUN[@]}" --nodes="$ACTOR_NODES" --ntasks-per-node=1 --nodelist="${ACTOR_NODELIST:1:-1}" \
  --kill-on-bad-exit=1 \
  bash -c "$NODE_RANK_WRAPPER" torchrun \
  torchrun --nnodes="$ACTOR_NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m megatron_bapo.train --config "$CONFIG" \
  model.hf_path="$MODEL_DIR" data.path="$DATA_PATH" trainer.output_dir="$OUTPUT_DIR" \
  "rollout.client.urls=$(yaml_list "${WORKER_URLS[@]}")" rollout.client.router_url="$ROUTER_URL" \
  sync.method=distributed sync.backend=nccl sync.master_address="$MASTER_ADDR" sync.master_port="$SYNC_PORT" \
  "$@"
ACTOR_PID=$BG_PID

# 5. The job ends with the actor; the EXIT trap stops the servers and the router.
status=0
wait_bg "$ACTOR_PID" || status=$?
log "actor exited with status $status"
exit "$status"
