#!/usr/bin/env bash
# A real single-node Slurm on this machine, for trying the examples/slurm/*.sbatch scripts and for the
# tests: installs Debian's slurm-wlm and munge when missing (needs root), writes a minimal slurm.conf
# for localhost into a state directory, and starts munged, slurmctld and slurmd.
#
#   sudo bash tools/slurm_local.sh start     # idempotent; prints the line to eval for the clients
#   eval "$(bash tools/slurm_local.sh env)"  # export SLURM_CONF=... for sbatch/squeue/scontrol
#   sbatch --ntasks-per-node 4 examples/slurm/pretrain_gpt_srun.sbatch
#   sudo bash tools/slurm_local.sh stop      # stops only the daemons this script started
#
# The node advertises SLURM_LOCAL_CPUS CPUs (default 8, whatever the hardware has: CPU jobs here are
# tiny and oversubscribing is fine), so a 4-task job fits even on a 2-core machine. Its own config
# file (SLURM_CONF) keeps any system Slurm untouched. On failure the last line names the check that
# failed and the exit code is 1.
set -uo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/megatron_po_slurm}
CPUS=${SLURM_LOCAL_CPUS:-8}
CTLD_PORT=${SLURM_LOCAL_PORT:-6817}
CONF=$DIR/slurm.conf
MUNGE_SOCKET=/run/munge/munge.socket.2

fail() { echo "slurm_local: $*" >&2; echo "slurm_local: FAILED: $*"; exit 1; }

install_packages() {
  command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || fail "slurm-wlm/munge are not installed and installing them needs root (uid $(id -u))"
  command -v apt-get >/dev/null || fail "slurm-wlm/munge are not installed and there is no apt-get to install them"
  echo "slurm_local: installing slurm-wlm and munge with apt-get"
  # A fresh machine may have no package lists yet; update only when the install fails without.
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge \
      >"$DIR/apt.log" 2>&1; then
    apt-get update -qq >>"$DIR/apt.log" 2>&1 || fail "apt-get update failed (see $DIR/apt.log)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge \
      >>"$DIR/apt.log" 2>&1 || fail "apt-get install slurm-wlm munge failed (see $DIR/apt.log)"
  fi
}

munge_works() { munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }

start_munge() {
  munge_works && return 0
  [ "$(id -u)" = 0 ] || fail "munged is not running and starting it needs root"
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null; then mungekey --create --keyfile /etc/munge/munge.key >/dev/null 2>&1
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; fi
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  chown munge:munge /etc/munge /etc/munge/munge.key && chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged --socket "$MUNGE_SOCKET" >"$DIR/munged.out" 2>&1 \
    || fail "munged did not start: $(tail -n 1 "$DIR/munged.out")"
  cp /run/munge/munged.pid "$DIR/munged.pid" 2>/dev/null || true   # ours: `stop` ends it too
  for _ in $(seq 50); do munge_works && return 0; sleep 0.1; done
  fail "munged started but 'munge -n | unmunge' fails (socket $MUNGE_SOCKET)"
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool"
  cat >"$CONF" <<EOF
# Written by tools/slurm_local.sh: one node (localhost), no accounting, no cgroups.
ClusterName=megatron-po-local
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=3600
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=localhost NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  mkdir -p "$DIR"
  install_packages
  start_munge
  export SLURM_CONF=$CONF
  if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid" && scontrol ping >/dev/null 2>&1; then
    echo "slurm_local: already running ($CONF)"
  else
    [ "$(id -u)" = 0 ] || fail "slurmctld/slurmd must be started as root"
    kill_daemons slurmd slurmctld
    write_conf
    rm -rf "$DIR/state"/* "$DIR/spool"/*
    slurmctld -c -f "$CONF" >"$DIR/slurmctld.out" 2>&1 \
      || fail "slurmctld did not start: $(tail -n 1 "$DIR/slurmctld.log" 2>/dev/null || cat "$DIR/slurmctld.out")"
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
    scontrol ping 2>/dev/null | grep -q UP || fail "slurmctld does not answer 'scontrol ping' (log: $DIR/slurmctld.log)"
    slurmd -N localhost -f "$CONF" >"$DIR/slurmd.out" 2>&1 \
      || fail "slurmd did not start: $(tail -n 1 "$DIR/slurmd.log" 2>/dev/null || cat "$DIR/slurmd.out")"
  fi
  for _ in $(seq 150); do
    state=$(sinfo -h -n localhost -o %T 2>/dev/null)
    case "$state" in idle*|mixed*|allocated*) echo "slurm_local: node localhost $state, $CPUS CPUs ($CONF)"
                                              echo "export SLURM_CONF=$CONF"; return 0 ;; esac
    sleep 0.2
  done
  fail "slurmd did not register node localhost with slurmctld (state '${state:-none}', log: $DIR/slurmd.log)"
}

kill_daemons() {  # the daemons named, by their pid files in $DIR (only what this script started)
  for d in "$@"; do
    if alive "$DIR/$d.pid"; then
      pid=$(cat "$DIR/$d.pid"); kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$DIR/$d.pid"
  done
}

stop() {
  kill_daemons slurmd slurmctld munged
  echo "slurm_local: stopped the daemons of $DIR"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
