#!/usr/bin/env bash
# A one-node or two-node Slurm cluster on this machine, for the tests marked `slurm` (tests/test_slurm_cluster.py):
#   bash scripts/slurm/test_cluster.sh start DIR             # install (as root, apt) if missing, configure, start, wait
#                                                            # for the node
#   bash scripts/slurm/test_cluster.sh start DIR --nodes 2   # two nodes, megarl-n1 and megarl-n2 (below)
#   bash scripts/slurm/test_cluster.sh stop DIR              # stop the daemons started in DIR, remove their network
# `start` prints `export SLURM_CONF=DIR/slurm.conf`, alone on stdout (for eval): the clients (sbatch, squeue) need it.
# Everything the cluster writes (munge key and socket, state, spool, logs) stays in DIR; ports 16817/16818 keep it
# clear of a system Slurm. Runs as root (slurmd must start job steps as their user); if `start` fails or is
# interrupted, it stops whatever it had started and exits non-zero with the reason on stderr. docs/clusters.md says
# how to use it by hand.
#
# Two nodes: each slurmd runs in network, UTS and mount namespaces of its own, so that it has its own address, its
# hostname is its Slurm node name (torchrun's c10d rendezvous starts its store on the node whose hostname is the
# endpoint's) and its /etc/hosts names both nodes. Network namespaces megarl-n1 and megarl-n2 (10.253.53.11 and .12)
# hang off the bridge megarl-br (10.253.53.1, where slurmctld listens, in this machine's own namespaces) through veths
# megarl-v1 and megarl-v2; ports 16827/16828. Names, subnet and ports differ from the one-node cluster's, so both can
# run at once (but only one two-node cluster: `start` refuses while the bridge exists). `ip netns exec` is not used
# for slurmd: it remounts /sys without /sys/fs/cgroup and slurmd fails to start. `stop DIR` removes the namespaces,
# veths and bridge named in DIR/network whatever state `start` left them in; the bind mounts of /etc/hosts live in the
# slurmds' private mount namespaces and go with their processes.
set -euo pipefail
usage="usage: bash scripts/slurm/test_cluster.sh start DIR [--nodes 1|2] | stop DIR"
action=${1:?$usage}
dir=$(realpath -m "${2:?$usage}")
nodes=1
if [[ $# -gt 2 ]]; then
  [[ $# -eq 4 && $3 == --nodes && ($4 == 1 || $4 == 2) ]] || { echo "$usage" >&2; exit 2; }
  nodes=$4
fi
subnet=${MEGARL_SLURM_SUBNET:-10.253.53}  # the two-node cluster's /24
bridge=megarl-br

stop_network() {
  # Whatever start_network made, as it recorded it in DIR/network before making it: processes left in the node
  # namespaces (none once slurmd and the jobs are stopped) killed, namespaces, veths and bridge removed.
  [[ -s $dir/network ]] || return 0
  local name pid
  for name in $(cat "$dir/network"); do
    case $name in
      megarl-n*)
        [[ -e /run/netns/$name ]] || continue
        for pid in $(ip netns pids "$name" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        for _ in $(seq 50); do [[ -z $(ip netns pids "$name" 2>/dev/null) ]] && break; sleep 0.1; done
        ip netns delete "$name" 2>/dev/null || true ;;
      *)  # the veths (their peers go with them; the kernel removes a deleted namespace's veths only later) and bridge
        ip link delete "$name" 2>/dev/null || true ;;
    esac
  done
  rm -f "$dir/network"
}

stop() {
  # Jobs first: their slurmstepd and processes outlive slurmd. Then slurmd, the controller and munge, which both need
  # until the end.
  if [[ -s $dir/slurmctld.pid ]] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    SLURM_CONF=$dir/slurm.conf scancel --partition=test 2>/dev/null || true
    for _ in $(seq 120); do
      [[ -z $(SLURM_CONF=$dir/slurm.conf squeue -h 2>/dev/null) ]] && break
      sleep 1
    done
  fi
  end "$dir"/slurmd.pid "$dir"/slurmd-*.pid  # the nodes' slurmd together: each takes seconds to end
  end "$dir/slurmctld.pid"
  end "$dir/munged.pid"
  rm -f "$dir"/*.pid
  stop_network
}

end() {
  # SIGTERM to the daemons of these pid files, SIGKILL to those still there 10 s later.
  local file pid pids=()
  for file in "$@"; do
    pid=$(cat "$file" 2>/dev/null) || continue
    kill "$pid" 2>/dev/null && pids+=("$pid")
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

start_network() {
  # The bridge and, for node i, namespace megarl-ni with eth0 at SUBNET.1i, paired with megarl-vi on the bridge.
  local tool
  for tool in ip nsenter unshare; do
    command -v $tool >/dev/null || fail "two nodes need ip (iproute2), nsenter and unshare (util-linux): no $tool here"
  done
  if ip link show "$bridge" >/dev/null 2>&1 || ip link show megarl-v1 >/dev/null 2>&1 ||
     ip link show megarl-v2 >/dev/null 2>&1 || [[ -e /run/netns/megarl-n1 || -e /run/netns/megarl-n2 ]]; then
    fail "bridge $bridge, veth megarl-v1/megarl-v2 or network namespace megarl-n1/megarl-n2 exists already:" \
      "another two-node cluster runs on this machine (bash scripts/slurm/test_cluster.sh stop ITS_DIR), or one was" \
      "left (ip netns delete megarl-n1; ip netns delete megarl-n2; ip link delete $bridge)"
  fi
  echo "megarl-n1 megarl-n2 megarl-v1 megarl-v2 $bridge" > "$dir/network"  # before making them: stop removes those
                                                                           # that exist
  ip link add "$bridge" type bridge || fail "cannot create a bridge here (ip link add $bridge type bridge failed)"
  ip addr add "$subnet.1/24" dev "$bridge" || fail "cannot give the bridge $bridge the address $subnet.1/24"
  ip link set "$bridge" up
  local i
  for i in 1 2; do
    ip netns add "megarl-n$i" || fail "cannot create a network namespace here (ip netns add megarl-n$i failed)"
    ip link add "megarl-v$i" type veth peer name eth0 netns "megarl-n$i" || fail "cannot create a veth pair here"
    ip link set "megarl-v$i" master "$bridge" up
    ip -n "megarl-n$i" addr add "$subnet.1$i/24" dev eth0
    ip -n "megarl-n$i" link set lo up
    ip -n "megarl-n$i" link set eth0 up
  done
  # The nodes' /etc/hosts, bind-mounted over theirs: the nodes by name (torchrun's rendezvous endpoint, the master
  # address it gives the workers), and this machine's name at the bridge's address.
  printf '127.0.0.1 localhost\n%s.1 %s\n%s.11 megarl-n1\n%s.12 megarl-n2\n' \
    "$subnet" "$(hostname -s)" "$subnet" "$subnet" > "$dir/hosts"
}

start_node() {
  # slurmd -N megarl-nI in the node's network namespace (nsenter: not `ip netns exec`, whose /sys has no cgroup
  # mount) and in UTS and mount namespaces of its own (unshare, private mounts) for its hostname and /etc/hosts.
  local i=$1
  mkdir -p "$dir/spool-megarl-n$i"
  nsenter --net="/run/netns/megarl-n$i" unshare --mount --uts sh -c \
    "hostname megarl-n$i && mount --bind '$dir/hosts' /etc/hosts && exec slurmd -f '$SLURM_CONF' -N megarl-n$i" ||
    fail "slurmd of megarl-n$i did not start: $(tail -5 "$dir/slurmd-megarl-n$i.log" 2>/dev/null)"
}

fail() {
  echo "test_cluster: $*" >&2
  exit 1
}

start() {
  if [[ $(id -u) != 0 ]]; then
    echo "test_cluster: needs root (slurmd starts job steps as their user, munged and slurmctld run as root here)" >&2
    exit 1
  fi
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null ||
     ! command -v sbatch >/dev/null; then
    command -v apt-get >/dev/null || { echo "test_cluster: slurmctld, slurmd, munge missing and no apt-get" >&2; exit 1; }
    echo "[test_cluster] installing slurmctld, slurmd, slurm-client and munge (Debian's slurm-wlm)" >&2
    # The packages' own services, where they start at all, have no slurm.conf: the daemons here are this script's.
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
  fi
  mkdir -p "$dir"
  stop  # daemons and network left by an earlier start in this directory
  # Whatever ends `start` before the nodes are up (a failed command, fail, Ctrl-C) stops the daemons it started and
  # removes the network it made.
  trap stop EXIT
  trap 'exit 1' INT TERM
  mkdir -p "$dir/ctld" "$dir/spool" "$dir/munge"
  chmod 700 "$dir/munge"
  [[ -s $dir/munge/munge.key ]] || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/munge.key"
  # --force: without it munged refuses a socket in a directory others cannot enter (the key's, kept private here).
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munge/seed" || fail "munged did not start: $(tail -3 "$dir/munged.log")"

  # The node as slurmd sees it: a node configured with more CPUs or memory than it finds is set INVALID.
  local host cpus mem
  host=$(hostname -s)
  cpus=$(slurmd -C | sed -n 's/.* CPUs=\([0-9]*\).*/\1/p')
  mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  local ctld_addr=127.0.0.1 ports=(16817 16818) slurmd_files=slurmd node_lines partition_nodes=$host
  node_lines="NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN"
  if [[ $nodes == 2 ]]; then
    start_network
    ctld_addr=$subnet.1 ports=(16827 16828) slurmd_files=slurmd-%n partition_nodes="megarl-n[1-2]"
    node_lines="NodeName=megarl-n1 NodeAddr=$subnet.11 NodeHostname=megarl-n1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=megarl-n2 NodeAddr=$subnet.12 NodeHostname=megarl-n2 CPUs=$cpus RealMemory=$mem State=UNKNOWN"
  fi
  cat > "$dir/slurm.conf" <<EOF
ClusterName=megarl-test
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/${slurmd_files/slurmd/spool}
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/$slurmd_files.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/$slurmd_files.log
# No cgroup hierarchy of our own in a container: track a job's processes by parent id, bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# GPUs are a known resource with none on this node, so the launchers' --gpus-per-node can be overridden to 0.
GresTypes=gpu
# A node that went down (a drained node resumed, slurmd restarted) comes back as soon as it registers again.
ReturnToService=2
KillWait=10
MinJobAge=600
$node_lines
PartitionName=test Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start: $(tail -5 "$dir/slurmctld.log" 2>/dev/null)"
  if [[ $nodes == 2 ]]; then
    start_node 1
    start_node 2
  else
    slurmd -f "$SLURM_CONF" || fail "slurmd did not start: $(tail -5 "$dir/slurmd.log" 2>/dev/null)"
  fi
  local states=""
  for _ in $(seq 120); do
    states=$(sinfo -h -N -o %T 2>/dev/null | tr '\n' ' ') || true
    [[ $states == "$(printf 'idle %.0s' $(seq "$nodes"))" ]] && break
    sleep 0.5
  done
  [[ $states == "$(printf 'idle %.0s' $(seq "$nodes"))" ]] ||
    fail "nodes are '${states:-unknown}', not all idle, 60 s after start: $(tail -5 "$dir"/slurmd*.log 2>/dev/null)"
  if [[ $nodes == 2 ]]; then  # the nodes reach each other (srun's step I/O, torchrun's rendezvous and gloo)
    nsenter --net=/run/netns/megarl-n1 bash -c "exec 3<>/dev/tcp/$subnet.12/${ports[1]}" 2>/dev/null ||
      fail "megarl-n1 cannot reach megarl-n2's slurmd at $subnet.12:${ports[1]} across the bridge $bridge"
  fi
  trap - EXIT INT TERM
  echo "export SLURM_CONF=$SLURM_CONF"
}

case $action in
  start) start ;;
  stop) stop ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
