#!/usr/bin/env bash
# Start a private one-node SLURM cluster on this machine for the launch-script tests.
#
#   eval "$(bash tests/slurm/start_cluster.sh [STATE_DIR])"    # exports SLURM_CONF
#   ... sbatch --wait ...
#   bash tests/slurm/stop_cluster.sh [STATE_DIR]
#
# Everything lives in STATE_DIR (default /tmp/bapo-slurm-$UID): its own munge key and socket, its own
# slurm.conf (selected with SLURM_CONF, so /etc/slurm and a system munged are never touched), spool,
# logs and PID files; daemons listen on SLURMCTLD_PORT/SLURMD_PORT (16817/16818). Installs Debian's
# slurmd, slurmctld, slurm-client and munge with apt-get when missing (needs root).
# Exit status 77: the cluster cannot be provided here (no packages and no way to install them);
# tests skip on it with the printed reason. Other non-zero: a real failure (see the logs).
set -euo pipefail

STATE_DIR=${1:-${SLURM_TEST_DIR:-/tmp/bapo-slurm-$(id -u)}}
SLURMCTLD_PORT=${SLURMCTLD_PORT:-16817}
SLURMD_PORT=${SLURMD_PORT:-16818}
START_TIMEOUT=${START_TIMEOUT:-60}

skip() {
  echo "start_cluster: SKIP: $*" >&2
  exit 77
}
fail() {
  echo "start_cluster: ERROR: $*" >&2
  exit 1
}

have_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
    command -v munged >/dev/null
}

if ! have_packages; then
  [ "$(id -u)" = 0 ] || skip "SLURM/munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || skip "SLURM/munge are not installed and apt-get is not available"
  echo "start_cluster: installing slurmd slurmctld slurm-client munge" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq slurmd slurmctld slurm-client munge; } >"${TMPDIR:-/tmp}/bapo-slurm-apt.log" 2>&1; then
    skip "apt-get could not install slurmd/slurmctld/slurm-client/munge (see ${TMPDIR:-/tmp}/bapo-slurm-apt.log)"
  fi
  have_packages || skip "SLURM/munge still missing after apt-get install"
fi
[ "$(id -u)" = 0 ] || skip "the one-node cluster runs slurmd as root; run the SLURM tests as root"

if [ -f "$STATE_DIR/slurmctld.pid" ] && kill -0 "$(cat "$STATE_DIR/slurmctld.pid")" 2>/dev/null; then
  bash "$(dirname "${BASH_SOURCE[0]}")/stop_cluster.sh" "$STATE_DIR"
fi
port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
for port in "$SLURMCTLD_PORT" "$SLURMD_PORT"; do
  port_in_use "$port" && fail "port $port is in use (another cluster? stop it with stop_cluster.sh, or set SLURMCTLD_PORT/SLURMD_PORT)"
done
mkdir -p "$STATE_DIR"/{state,spool,log}
# A failed start leaves nothing running.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
on_exit() {
  local status=$?
  [ "$status" = 0 ] || bash "$HERE/stop_cluster.sh" "$STATE_DIR"
  return "$status"
}
trap on_exit EXIT
chmod 755 "$STATE_DIR"
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(awk '/MemAvailable/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)

# munge: private key, socket and daemon
KEY=$STATE_DIR/munge.key
SOCKET=$STATE_DIR/munge.socket
dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
chmod 400 "$KEY"
munged --force --key-file="$KEY" --socket="$SOCKET" --pid-file="$STATE_DIR/munged.pid" \
  --log-file="$STATE_DIR/log/munged.log" --seed-file="$STATE_DIR/munge.seed"
for _ in $(seq 50); do
  [ -S "$SOCKET" ] && break
  sleep 0.1
done
munge -n -S "$SOCKET" | unmunge -S "$SOCKET" >/dev/null || fail "munge does not work (see $STATE_DIR/log/munged.log)"

CONF=$STATE_DIR/slurm.conf
cat >"$CONF" <<CONF
ClusterName=bapotest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$SLURMCTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=10
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF=$CONF

slurmctld -f "$CONF" -i
slurmd -f "$CONF"
deadline=$((SECONDS + START_TIMEOUT))
until [ "$(sinfo -h -o %T 2>/dev/null | head -n1)" = idle ]; do
  [ "$SECONDS" -ge "$deadline" ] && fail "the node did not become idle within ${START_TIMEOUT}s (see $STATE_DIR/log)"
  sleep 0.5
done
echo "start_cluster: one-node cluster up ($HOST, $CPUS CPUs, ${MEM_MB} MB) in $STATE_DIR" >&2
echo "export SLURM_CONF=$CONF"
