#!/usr/bin/env bash
# A simulated cluster on this machine: H hosts as network namespaces on one bridge, each with its
# own host name, joined by real TCP over veth links (optionally rate-limited); runs COMMAND on
# host 0 and tears everything down when it ends, however it ends.
#
#   scripts/cluster.sh [--hosts H] [--slots R] [--rate RATE] -- COMMAND [ARGS...]
#
#   --hosts H     hosts (default 2)
#   --slots R     MPI ranks per host in the hostfile (default 2)
#   --rate RATE   each host's link, both directions, as tc writes rates (200mbit, 1gbit);
#                 default: unlimited
#
# COMMAND runs in host 0's namespace with these in its environment:
#   CLUSTER_MPIEXEC   an mpiexec that launches over the cluster's hosts (hostfile, an `ip netns
#                     exec` stand-in for ssh, TCP between hosts on the cluster's subnet only):
#                     "$CLUSTER_MPIEXEC" -n 4 ./train_gpt --backend mpi
#   CLUSTER_LINK      changes or reads a host's link while COMMAND runs:
#                     "$CLUSTER_LINK" 1 down | up | rate 10mbit [QUEUE] | unlimited | tx_bytes | rx_bytes
#                     (QUEUE: how long a packet may wait before it is dropped; 100ms unless given)
#   CLUSTER_HOSTS, CLUSTER_SLOTS, CLUSTER_DIR (scratch; removed at the end), CLUSTER_NETNS (the
#   hosts' network namespaces: `ip netns pids` lists what runs on each)
# and exits with COMMAND's status; 77 (ctest's skip code) when namespaces cannot be made here
# (not root), saying why.
#
# Each host is a network namespace (its addresses exist only inside the cluster: 10.77.0.0/24)
# and a UTS namespace (Open MPI names its shared-memory segments after the host name: hosts
# sharing one name collide in /dev/shm). Every name carries this script's process id, so
# clusters of parallel tests do not meet. No delay option: tc's netem is not in this machine's
# kernel ("Specified qdisc kind is unknown"), and tbf shapes rate only.
set -euo pipefail

hosts=2 slots=2 rate=""
while [ $# -gt 0 ]; do
  case $1 in
    --hosts) hosts=$2; shift 2 ;;
    --slots) slots=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "cluster.sh: unknown option '$1' (usage: cluster.sh [--hosts H] [--slots R] [--rate RATE] -- COMMAND...)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "cluster.sh: no COMMAND given" >&2; exit 2; }
[[ $hosts =~ ^[1-9][0-9]?$ && $hosts -le 200 ]] || { echo "cluster.sh: --hosts must be 1..200, got '$hosts'" >&2; exit 2; }
[[ $slots =~ ^[1-9][0-9]*$ ]] || { echo "cluster.sh: --slots must be a positive number, got '$slots'" >&2; exit 2; }

id="fc$$"                       # namespaces fc<pid>h0.., switch fc<pid>sw
subnet=10.77.0
dir=$(mktemp -d "/tmp/cluster.$id.XXXX")
ns() { echo "${id}h$1"; }
sw="${id}sw"

teardown() {
  local n
  for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$id" || true); do
    ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$n" 2>/dev/null || true
  done
  rm -rf "$dir" /dev/shm/*"$id"* 2>/dev/null || true
}
trap teardown EXIT
trap 'exit 130' INT TERM

if ! ip netns add "$sw" 2>"$dir/err"; then
  echo "cluster.sh: skipped: cannot create network namespaces here ($(cat "$dir/err")); run as root" >&2
  exit 77
fi
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up
for ((h = 0; h < hosts; h++)); do
  ip netns add "$(ns $h)"
  ip link add eth0 netns "$(ns $h)" type veth peer name "h$h" netns "$sw"
  ip -n "$sw" link set "h$h" master br0 up
  ip -n "$(ns $h)" addr add "$subnet.$((h + 1))/24" dev eth0
  ip -n "$(ns $h)" link set eth0 up
  ip -n "$(ns $h)" link set lo up
  echo "$subnet.$((h + 1)) slots=$slots" >>"$dir/hostfile"
done

# CLUSTER_LINK: a host's link, both directions (the host's eth0 sends, the switch's port
# delivers to it). tbf: burst 64 KiB (above the 1500-byte MTU at every rate used here), packets
# wait up to QUEUE (100 ms unless given) before being dropped.
cat >"$dir/link" <<EOF
#!/usr/bin/env bash
set -euo pipefail
h=\$1 what=\$2
shape() { tc -n "\$1" qdisc replace dev "\$2" root tbf rate "\$3" burst 64kb latency "\$4"; }
case \$what in
  down) ip -n "$sw" link set "h\$h" down ;;
  up) ip -n "$sw" link set "h\$h" up ;;
  rate) shape "${id}h\$h" eth0 "\$3" "\${4:-100ms}"; shape "$sw" "h\$h" "\$3" "\${4:-100ms}" ;;
  unlimited) tc -n "${id}h\$h" qdisc del dev eth0 root 2>/dev/null || true; tc -n "$sw" qdisc del dev "h\$h" root 2>/dev/null || true ;;
  tx_bytes|rx_bytes) ip netns exec "${id}h\$h" cat "/sys/class/net/eth0/statistics/\$what" ;;
  *) echo "CLUSTER_LINK HOST down|up|rate RATE [QUEUE]|unlimited|tx_bytes|rx_bytes" >&2; exit 2 ;;
esac
EOF
if [ -n "$rate" ]; then
  for ((h = 0; h < hosts; h++)); do bash "$dir/link" "$h" rate "$rate"; done
fi

# The ssh stand-in Open MPI calls as `agent [options] HOST COMMAND...` (plm_rsh_agent): runs the
# command on that host, under its own host name, as ssh would through a login shell.
cat >"$dir/agent" <<EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done
host=\$1; shift
h=\$(( \${host##*.} - 1 ))
exec ip netns exec "${id}h\$h" unshare --uts sh -c "hostname $id-h\$h && exec \$*"
EOF
# The launcher: TCP between hosts only on the cluster's subnet (btl for MPI traffic, oob for
# Open MPI's own), shared memory inside a host.
cat >"$dir/mpiexec" <<EOF
#!/bin/sh
exec mpiexec --allow-run-as-root --hostfile "$dir/hostfile" --map-by slot \\
  --mca plm_rsh_agent "$dir/agent" --mca btl self,vader,tcp \\
  --mca btl_tcp_if_include $subnet.0/24 --mca oob_tcp_if_include $subnet.0/24 "\$@"
EOF
chmod +x "$dir/link" "$dir/agent" "$dir/mpiexec"

netns=""
for ((h = 0; h < hosts; h++)); do netns+="${netns:+ }$(ns $h)"; done
export CLUSTER_MPIEXEC="$dir/mpiexec" CLUSTER_LINK="$dir/link" CLUSTER_HOSTS=$hosts CLUSTER_SLOTS=$slots CLUSTER_DIR=$dir \
  CLUSTER_NETNS="$netns"
set +e
ip netns exec "$(ns 0)" unshare --uts sh -c "hostname $id-h0 && exec \"\$@\"" sh "$@"
status=$?
set -e
exit $status
