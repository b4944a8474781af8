# shellcheck shell=bash
# Shared functions of the SLURM launch scripts (examples/run_32b_bapo.sh, examples/run_tiny_slurm.sh).
# Source it; it defines functions and arrays only.
#
# Every command goes through `run_cmd` / `start_bg`, so DRY_RUN=1 prints each command (in a form
# that can be pasted into a shell) instead of running it. Background job steps are remembered by
# PID and `cleanup` stops exactly those PIDs (TERM, then KILL after CLEANUP_TIMEOUT seconds): an
# `srun` that receives SIGTERM ends its job step on every node. Nothing is ever killed by name.

BG_PIDS=()
BG_NAMES=()

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

die() {
  log "ERROR: $*"
  exit 1
}

is_dry_run() { [ "${DRY_RUN:-0}" = 1 ]; }

# show_cmd PREFIX CMD...: print a command; arguments with shell-special characters are quoted.
show_cmd() {
  local prefix=$1 arg line=""
  shift
  for arg in "$@"; do
    if [[ $arg =~ ^[][A-Za-z0-9_./:=@%+,{}-]+$ ]]; then
      line+="$arg "
    else
      line+="$(printf '%q' "$arg") "
    fi
  done
  printf '%s %s\n' "$prefix" "${line% }"
}

# run_cmd CMD...: run a command in the foreground (printed first; only printed with DRY_RUN=1).
run_cmd() {
  show_cmd "+" "$@"
  is_dry_run && return 0
  "$@"
}

# start_bg NAME CMD...: start a command in the background with its output in $LOG_DIR/NAME.log;
# remember its PID for cleanup (also written to $LOG_DIR/NAME.pid). Sets BG_PID.
start_bg() {
  local name=$1
  shift
  show_cmd "+ [bg:$name]" "$@"
  BG_PID=0
  is_dry_run && return 0
  "$@" >"$LOG_DIR/$name.log" 2>&1 &
  BG_PID=$!
  BG_PIDS+=("$BG_PID")
  BG_NAMES+=("$name")
  printf '%s\n' "$BG_PID" >"$LOG_DIR/$name.pid"
  log "started $name (pid $BG_PID, log $LOG_DIR/$name.log)"
}

# cleanup: stop every background step this script started (newest first), by PID only.
cleanup() {
  local status=$? i pid alive deadline
  trap - EXIT INT TERM
  if [ "${#BG_PIDS[@]}" -gt 0 ]; then
    log "cleanup: stopping ${#BG_PIDS[@]} background step(s)"
    for ((i = ${#BG_PIDS[@]} - 1; i >= 0; i--)); do
      pid=${BG_PIDS[$i]}
      if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
      fi
    done
    deadline=$((SECONDS + ${CLEANUP_TIMEOUT:-60}))
    while :; do
      alive=()
      for pid in "${BG_PIDS[@]}"; do
        kill -0 "$pid" 2>/dev/null && alive+=("$pid")
      done
      [ "${#alive[@]}" -eq 0 ] && break
      if [ "$SECONDS" -ge "$deadline" ]; then
        log "cleanup: SIGKILL to pids ${alive[*]} after ${CLEANUP_TIMEOUT:-60}s"
        kill -KILL "${alive[@]}" 2>/dev/null || true
        break
      fi
      sleep 1
    done
    for pid in "${BG_PIDS[@]}"; do
      wait "$pid" 2>/dev/null || true
    done
  fi
  log "cleanup: done (exit status $status)"
  exit "$status"
}

# install_cleanup_trap: run cleanup on normal exit, on errors (set -e) and on INT/TERM (scancel).
install_cleanup_trap() {
  trap cleanup EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
}

# job_nodes: the job's hostnames, one per line. NODES="a b c" overrides (and is required outside
# an allocation unless DRY_RUN=1, where placeholders node001.. are printed for NUM_NODES nodes).
job_nodes() {
  if [ -n "${NODES:-}" ]; then
    local -a nodes
    read -r -a nodes <<<"$NODES"
    printf '%s\n' "${nodes[@]}"
  elif [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    scontrol show hostnames "$SLURM_JOB_NODELIST"
  elif is_dry_run; then
    local i
    for ((i = 1; i <= ${NUM_NODES:-1}; i++)); do printf 'node%03d\n' "$i"; done
  else
    die "not inside a SLURM allocation (SLURM_JOB_NODELIST is unset): submit with sbatch or set NODES"
  fi
}

# http_ok URL: true when URL answers 2xx within 5 s.
http_ok() {
  curl -sf -o /dev/null --max-time 5 "$1"
}

# wait_for_health TIMEOUT_S PID URL...: poll URL/health until all answer; fail early if PID (the
# step serving them; 0 = none) has exited, showing the end of its log.
wait_for_health() {
  local timeout=$1 pid=$2 url deadline
  shift 2
  if is_dry_run; then
    for url in "$@"; do show_cmd "+ [wait]" curl -sf "$url/health"; done
    return 0
  fi
  deadline=$((SECONDS + timeout))
  for url in "$@"; do
    until http_ok "$url/health"; do
      if [ "$pid" != 0 ] && ! kill -0 "$pid" 2>/dev/null; then
        die "the step serving $url (pid $pid) exited before becoming healthy; see the logs in $LOG_DIR"
      fi
      [ "$SECONDS" -ge "$deadline" ] && die "$url/health did not answer within ${timeout}s"
      sleep 2
    done
    log "healthy: $url"
  done
}

# wait_bg PID: wait for one background step and return its exit status (interruptible by traps).
wait_bg() {
  local pid=$1 status=0
  is_dry_run && return 0
  wait "$pid" || status=$?
  return "$status"
}

# yaml_list ITEM...: "[a,b,c]", the form of a list override (rollout.client.urls=[...]).
yaml_list() {
  local IFS=,
  printf '[%s]' "$*"
}

# srun_prefix: srun plus the container options when CONTAINER_IMAGE is set (pyxis/enroot).
# Prints one argument per line; read it with mapfile.
srun_prefix() {
  printf '%s\n' srun
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    printf '%s\n' "--container-image=$CONTAINER_IMAGE"
    [ -n "${CONTAINER_MOUNTS:-}" ] && printf '%s\n' "--container-mounts=$CONTAINER_MOUNTS"
    printf '%s\n' "--container-workdir=${CONTAINER_WORKDIR:-$PWD}"
  fi
  return 0
}

# config_value KEY DEFAULT CONFIG [OVERRIDE...]: a "section.key" value of the run config as the
# trainer reads it: the last KEY=value override wins, else the key under its top-level section of
# the YAML (two levels, the scripts' configs), else DEFAULT.
config_value() {
  local key=$1 default=$2 config=$3 arg value=""
  shift 3
  for arg in "$@"; do
    [[ $arg == "$key="* ]] && value=${arg#*=}
  done
  if [ -z "$value" ] && [ -f "$config" ]; then
    value=$(awk -v s="${key%%.*}" -v k="${key#*.}" '
      /^[^[:space:]#]/ { insec = ($0 ~ "^" s ":") }
      insec && $0 ~ "^  " k ":" { sub("^  " k ":[[:space:]]*", ""); sub("[[:space:]]*#.*$", ""); print; exit }
    ' "$config")
  fi
  printf '%s\n' "${value:-$default}"
}

# sync_server_flags CONFIG [OVERRIDE...]: sets SYNC_FLAGS, the server flags the weight sync and the
# client rely on (megatron_bapo.rollout.sglang_launch.required_server_flags; the first weight update refuses
# a server without them): --enable-deterministic-inference when rollout.deterministic_inference is
# true (requests carry sampling seeds, ignored otherwise), --disable-radix-cache when
# sync.pause_mode is in_place (the update cannot flush KV the old weights computed),
# --enable-return-routed-experts when rollout.return_routed_experts is true (MoE routing replay:
# ignored without the flag), and --weight-version 0 (the servers start from the initial policy, version 0).
sync_server_flags() {
  SYNC_FLAGS=()
  [ "$(config_value rollout.deterministic_inference false "$@")" = true ] && SYNC_FLAGS+=(--enable-deterministic-inference)
  [ "$(config_value sync.pause_mode null "$@")" = in_place ] && SYNC_FLAGS+=(--disable-radix-cache)
  [ "$(config_value rollout.return_routed_experts false "$@")" = true ] && SYNC_FLAGS+=(--enable-return-routed-experts)
  SYNC_FLAGS+=(--weight-version 0)
}
