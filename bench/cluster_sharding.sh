#!/usr/bin/env bash
# Tokens/s of train_gpt on a simulated cluster of 2 hosts x 2 MPI ranks (scripts/cluster.sh,
# needs root) for --sharding full, hybrid (per host), none and auto, at each link rate given
# (default 200mbit 1gbit); and auto's ratio to the best of the three it chooses from, measured
# in the same run. docs/multi-host.md quotes its output.
#   bench/cluster_sharding.sh BUILD_DIR [RATE...]      e.g. bench/cluster_sharding.sh build/release
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: bench/cluster_sharding.sh BUILD_DIR [RATE...]}
shift
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(200mbit 1gbit)
gpt=$(realpath "$build/examples/train_gpt")
# The issue's shape: 4 layers, width 128; 20 steps after the 3 auto profiles. The plain-loop
# matrix products, as docs/multi-host.md's figures were measured (OpenBLAS makes compute 3.7x
# faster and the run more communication-bound: to be measured again).
args=(--backend mpi --layers 4 --dim 128 --steps 20 --eval-every 0 --matmul loops)
for rate in "${rates[@]}"; do
  scripts/cluster.sh --rate "$rate" -- bash -c '
    gpt=$1; rate=$2; shift 2
    declare -A tps
    for s in full hybrid none auto; do
      out=$("$CLUSTER_MPIEXEC" -n 4 "$gpt" "$@" --sharding "$s")
      tps[$s]=$(sed -nE "s/.* ([0-9]+) tokens\/s; .*/\1/p" <<<"$out")
      [ "$s" = auto ] && chose=$(sed -n "s/^chose //p" <<<"$out")
      echo "$rate  --sharding $s: ${tps[$s]} tokens/s"
    done
    best=${tps[full]}; for s in hybrid none; do [ "${tps[$s]}" -gt "$best" ] && best=${tps[$s]}; done
    echo "$rate  auto chose $chose: $(awk -v a="${tps[auto]}" -v b="$best" "BEGIN { printf \"%.3f\", a / b }") of the best"
  ' bash "$gpt" "$rate" "${args[@]}"
done
