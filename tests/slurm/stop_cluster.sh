#!/usr/bin/env bash
# Stop the private one-node SLURM cluster started by start_cluster.sh: slurmd, slurmctld, munged,
# each by the PID in its PID file (TERM, then KILL after STOP_TIMEOUT seconds). Never by name.
set -euo pipefail

STATE_DIR=${1:-${SLURM_TEST_DIR:-/tmp/bapo-slurm-$(id -u)}}
STOP_TIMEOUT=${STOP_TIMEOUT:-20}

stop_pidfile() {
  local file=$1 pid deadline
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT))
    while kill -0 "$pid" 2>/dev/null; do
      if [ "$SECONDS" -ge "$deadline" ]; then
        kill -KILL "$pid" 2>/dev/null || true
        break
      fi
      sleep 0.2
    done
  fi
  rm -f "$file"
}

for name in slurmd slurmctld munged; do
  stop_pidfile "$STATE_DIR/$name.pid"
done
echo "stop_cluster: stopped the cluster in $STATE_DIR" >&2
