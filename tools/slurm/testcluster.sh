#!/usr/bin/env bash
# A real multi-node Slurm cluster on one machine, for ramjet's Slurm test
# (bindings/tests/test_slurm.py) and for trying tools/slurm/ by hand.
#
# Each node is a network namespace (its own address on a bridge), a UTS namespace (its own host
# name) and a mount namespace (its own /etc/hosts, which names every node), running its own
# slurmd from Debian's slurm-wlm. slurmctld and one munged run beside them in the root
# namespace; the nodes reach munged through its socket file. Nodes are entered with nsenter and
# unshare, not `ip netns exec`: that one remounts /sys, and slurmd then finds no cgroup
# filesystem.
#
# Usage (as root):
#   tools/slurm/testcluster.sh start   # installs slurm-wlm and munge when missing, starts it
#   tools/slurm/testcluster.sh env     # prints the exports a client needs (SLURM_CONF, ...)
#   tools/slurm/testcluster.sh stop    # stops every daemon, removes namespaces, bridge, files
#
# Settings: RAMJET_SLURM_NODES (default 3). One cluster per RAMJET_S3_PORT (tools/env.sh), so
# a CI run and a developer's run on one machine use different names, subnets and ports.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../env.sh"

inst=$((RAMJET_S3_PORT / 100 % 200))
nodes=${RAMJET_SLURM_NODES:-3}
dir=/tmp/ramjet-slurm-$inst        # every parent must be searchable by all (munged checks)
net=10.213.$inst
bridge=rj${inst}br
ctl_port=$((17000 + inst * 4))
slurmd_port=$((ctl_port + 1))
host=$(hostname)

ns() { echo "rj$inst-node$1"; }

say() { echo "testcluster: $*" >&2; }

client_env() {
  cat <<EOF
export SLURM_CONF=$dir/slurm.conf
export RAMJET_SLURM_GATEWAY=$net.1
export RAMJET_SLURM_NODELIST=node[1-$nodes]
export RAMJET_SLURM_DIR=$dir
EOF
}

stop() {
  local pids=() f p i
  for f in "$dir"/run/slurmd-*.pid "$dir"/run/slurmctld.pid "$dir"/munge/munged.pid; do
    [ -f "$f" ] && pids+=("$(cat "$f")")
  done
  for i in $(seq 1 "$nodes"); do
    # Everything running in a node (slurmd, a step it left behind) goes with it.
    pids+=($(ip netns pids "$(ns "$i")" 2>/dev/null || true))
  done
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 1 20); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && break
    sleep 0.25
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  for i in $(seq 1 "$nodes"); do
    ip netns del "$(ns "$i")" 2>/dev/null || true
    # The root end of the node's link: deleting it removes both ends, even while a process
    # that was in the namespace is still being reaped.
    ip link del "rj${inst}v$i" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  rm -rf "$dir"
}

start() {
  [ "$(id -u)" -eq 0 ] || { say "needs root (namespaces, bridge, slurmd)"; exit 1; }
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    say "installing Debian's slurm-wlm and munge"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }
  fi
  stop
  mkdir -p "$dir"/{run,log,ctld,spool,munge}
  chmod 755 "$dir" "$dir/munge"

  # munged, with a key of this cluster's own (the packaged key belongs to the munge user).
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 2>/dev/null
  chmod 400 "$dir/munge/munge.key"
  munged --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"

  # The network: a bridge in the root namespace, one veth into each node.
  ip link add "$bridge" type bridge
  ip addr add "$net.1/24" dev "$bridge"
  ip link set "$bridge" up
  printf '127.0.0.1 localhost\n%s %s\n' "$net.1" "$host" >"$dir/hosts"
  for i in $(seq 1 "$nodes"); do
    n=$(ns "$i")
    ip netns add "$n"
    ip link add "rj${inst}v$i" type veth peer name eth0 netns "$n"
    ip link set "rj${inst}v$i" master "$bridge" up
    ip -n "$n" addr add "$net.$((10 + i))/24" dev eth0
    ip -n "$n" link set lo up
    ip -n "$n" link set eth0 up
    ip -n "$n" route add default via "$net.1"
    echo "$net.$((10 + i)) node$i" >>"$dir/hosts"
  done

  {
    echo "ClusterName=ramjet$inst"
    echo "SlurmctldHost=$host($net.1)"
    echo "SlurmctldPort=$ctl_port"
    echo "SlurmdPort=$slurmd_port"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$dir/munge/munge.socket"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$dir/ctld"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
    echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/log/slurmctld.log"
    echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SchedulerType=sched/backfill"
    echo "SwitchType=switch/none"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "KillWait=5"
    echo "MinJobAge=600"
    echo "InactiveLimit=0"
    echo "SlurmdTimeout=60"
    # The CPUs slurmd will find: nproc without the OpenMP variables, which it obeys (a caller
    # that imported Ultralytics has OMP_NUM_THREADS=1; the nodes then had 1 CPU each, and two
    # jobs on the same nodes ran one after the other).
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    for i in $(seq 1 "$nodes"); do
      echo "NodeName=node$i NodeAddr=$net.$((10 + i)) CPUs=$cpus RealMemory=1000 State=UNKNOWN"
    done
    echo "PartitionName=ramjet Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
  } >"$dir/slurm.conf"

  export SLURM_CONF="$dir/slurm.conf"
  slurmctld
  for i in $(seq 1 "$nodes"); do
    nsenter --net="/var/run/netns/$(ns "$i")" unshare --uts --mount sh -c \
      "mount --bind '$dir/hosts' /etc/hosts && hostname node$i && exec slurmd"
  done

  # Up when every node is idle.
  for _ in $(seq 1 120); do
    idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)
    [ "$idle" -eq "$nodes" ] && break
    sleep 0.5
  done
  if [ "${idle:-0}" -ne "$nodes" ]; then
    say "only ${idle:-0} of $nodes nodes came up idle:"
    sinfo -N >&2 || true
    tail -n 20 "$dir"/log/*.log >&2 || true
    exit 1
  fi
  say "up: $nodes nodes (node[1-$nodes] on $net.0/24), slurmctld on $net.1:$ctl_port"
  client_env >"$dir/env"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) client_env ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
