#!/usr/bin/env bash
# Run by scripts/cluster.sh (2 hosts x 2 slots): train_gpt as 4 MPI processes on 2 hosts, for
# each sharding, against 4 thread ranks in one process told of the same 2 hosts (--hosts 2;
# the backends sum in the same order, so the losses agree to the last bit). Checks:
#   - the loss curves are identical, and so are the bytes each rank sent and sent across hosts
#     (MPI finds its hosts from shared memory; the threads run is told them);
#   - --sharding hybrid makes shard groups of the ranks of one host;
#   - --sharding auto picks one of them and trains exactly as that one does;
#   - the bytes that actually crossed host 0's link (the kernel's count for its interface) are
#     at least what the counters say its ranks sent to the other host, and at most 10% more
#     (packet headers, MPI's own messages, the launcher).
# Usage: across_hosts.sh TRAIN_GPT
set -euo pipefail
gpt=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--steps 6 --eval-every 0 --layers 2 --dim 64)
fail() { echo "FAIL: $*" >&2; exit 1; }

for s in full grad_op hybrid none; do
  before=$("$CLUSTER_LINK" 0 tx_bytes)
  "$CLUSTER_MPIEXEC" -n 4 "$gpt" --backend mpi --sharding "$s" "${args[@]}" --loss-csv "$work/mpi_$s.csv" >"$work/mpi_$s.out" 2>&1 ||
    { cat "$work/mpi_$s.out"; fail "$s: the MPI run across hosts failed"; }
  after=$("$CLUSTER_LINK" 0 tx_bytes)
  "$gpt" --ranks 4 --hosts 2 --sharding "$s" "${args[@]}" --loss-csv "$work/threads_$s.csv" >"$work/threads_$s.out" 2>&1 ||
    { cat "$work/threads_$s.out"; fail "$s: the threads run failed"; }
  cmp "$work/mpi_$s.csv" "$work/threads_$s.csv" || fail "$s: the loss curves differ (2 hosts x 2 MPI ranks vs 4 thread ranks)"
  sent_mpi=$(grep '^bytes sent per rank' "$work/mpi_$s.out") || fail "$s: no traffic line"
  sent_threads=$(grep '^bytes sent per rank' "$work/threads_$s.out")
  [ "$sent_mpi" = "$sent_threads" ] || fail "$s: traffic differs: mpi '$sent_mpi' vs threads '$sent_threads'"
  grep -q '^hosts: 2 hosts: \[0 0 1 1\]' "$work/mpi_$s.out" || fail "$s: MPI did not find 2 hosts of 2 ranks"

  # Ranks 0 and 1 are host 0's: what they sent to host 1 crossed its link.
  inter=$(sed -E 's/.*to other hosts: \[([0-9]+) ([0-9]+) .*/\1 + \2/' <<<"$sent_mpi")
  counted=$((inter))
  wire=$((after - before))
  echo "$s: host 0 sent $wire bytes on its link; its ranks counted $counted to the other host" \
    "(ratio $(awk -v w="$wire" -v c="$counted" 'BEGIN { printf "%.3f", w / c }'))"
  [ "$counted" -gt 0 ] || fail "$s: no inter-host bytes counted"
  [ "$wire" -ge "$counted" ] || fail "$s: fewer bytes crossed the link ($wire) than the counters say were sent across ($counted)"
  [ "$wire" -le $((counted * 110 / 100)) ] || fail "$s: $wire bytes crossed the link, over 10% more than the $counted counted"
done
grep -q 'shard groups of 2 ranks (hybrid), 2 replicas' "$work/mpi_hybrid.out" || fail "hybrid: shard groups are not the hosts"

# --sharding auto measures both levels, prints its table, and trains exactly as the sharding it
# chose does (its profiling steps leave no trace in the model).
"$CLUSTER_MPIEXEC" -n 4 "$gpt" --backend mpi --sharding auto "${args[@]}" --loss-csv "$work/mpi_auto.csv" >"$work/mpi_auto.out" 2>&1 ||
  { cat "$work/mpi_auto.out"; fail "auto: the run failed"; }
grep -A4 '^sharding auto: 2 host(s) of 2 ranks; inside a host .* across hosts ' "$work/mpi_auto.out" || fail "auto: no table"
chose=$(sed -n 's/^chose //p' "$work/mpi_auto.out")
case $chose in
  "full_shard()") same=full ;;
  "hybrid_shard_per_host()") same=hybrid ;;
  "no_shard()") same=none ;;
  *) fail "auto chose '$chose', not one of full, hybrid per host, none" ;;
esac
cmp "$work/mpi_auto.csv" "$work/mpi_$same.csv" || fail "auto chose $chose but its losses differ from --sharding $same's"
echo "auto chose $chose; its losses equal --sharding $same's"
echo "PASS: 2 hosts x 2 ranks: losses and traffic as on one host, for full, grad_op, hybrid and none; auto as its choice"
