#!/usr/bin/env bash
# The benchmarks, in one command: builds the Release tree (build/release, as
# scripts/run-example.sh makes it), then runs
#   1. fsdp_bench: toolkit overhead, threads-backend collectives and every other registered
#      benchmark (Google Benchmark; 3 repetitions, the console shows their medians),
#   2. mpi_collectives under mpiexec with 2 and 4 processes (when an MPI is installed),
#   3. `fsdp_bench plans`: simulated plans for Llama-3-like models on H100 clusters, and
#      `fsdp_bench accounting`: traffic and memory per rank of every sharding and mode (counts),
#   4. `fsdp_bench overlap`: the plans run on the GPT program with a modelled link, against the
#      simulator's predictions,
#   5. checkpoint: sharded save/load against plain write/read, async against sync save,
#   6. as root with MPI: bench/cluster_sharding.sh, train_gpt on a simulated cluster of 2 hosts
#      x 2 ranks at 200 Mbit/s and 1 Gbit/s for each sharding and auto (about 3 minutes),
#   7. bench/goals.py: the collective and hook figures of 1 and 2 against their goals (issue 15).
# Results go to build/bench/: fsdp_bench.json (every run, Google Benchmark's JSON),
# fsdp_bench.txt, mpi_collectives_<n>.txt, plans.txt, accounting.txt, overlap.txt, checkpoint.txt,
# cluster_sharding.txt, goals.txt.
# docs/benchmarks.md explains them.
# Extra arguments go to fsdp_bench, e.g.: scripts/bench.sh --benchmark_filter=overhead
# About 6 minutes on 2 cores (2026-11-27, cluster_sharding included): building, the sweeps below,
# the GPT step benchmark (about 10 seconds: loops and OpenBLAS, 2 and 4 ranks) and the MPI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
jobs=${FSDP_JOBS:-$(nproc)}
out=build/bench
mkdir -p "$out"

echo "== build (Release, build/release)"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=OFF -DFSDP_NATIVE_ARCH=ON >/dev/null
has_target() { ninja -C build/release -t targets all 2>/dev/null | grep -q "^$1: phony"; }
if ! has_target fsdp_bench; then
  echo "bench: CMake did not find Google Benchmark (libbenchmark-dev), so there is no fsdp_bench" >&2
  exit 1
fi
targets=(fsdp_bench checkpoint_bench)
has_target mpi_collectives && targets+=(mpi_collectives)
cmake --build build/release -j "$jobs" --target "${targets[@]}"
bench=build/release/bench/fsdp_bench

echo "== fsdp_bench"
# min_time 0.3 s per run and 3 repetitions: the overhead and collective sweeps take about a
# minute on 2 cores. The console keeps the medians (the file keeps mean, stddev and cv too).
"$bench" --benchmark_min_time=0.3 --benchmark_repetitions=3 --benchmark_display_aggregates_only=true \
  --benchmark_counters_tabular=true --benchmark_out="$out/fsdp_bench.json" --benchmark_out_format=json "$@" |
  tee "$out/fsdp_bench.txt" | { grep -v -E '_(mean|stddev|cv) ' || true; }

if [[ " ${targets[*]} " == *" mpi_collectives "* ]]; then
  # Open MPI refuses root without both variables; 4 processes oversubscribe 2 cores.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  for n in 2 4; do
    echo "== mpi_collectives, $n processes"
    mpiexec --oversubscribe -n "$n" build/release/bench/mpi_collectives --reps 25 | tee "$out/mpi_collectives_$n.txt"
  done
else
  echo "== mpi_collectives: skipped (CMake found no MPI)"
fi

echo "== fsdp_bench plans"
"$bench" plans | tee "$out/plans.txt"
echo "== fsdp_bench accounting (traffic and memory per rank of every sharding and mode: exact counts)"
"$bench" accounting | tee "$out/accounting.txt"
echo "== fsdp_bench overlap (the GPT program on a modelled link: plans measured against the simulator)"
"$bench" overlap --ranks 2 --latency-ms 30 --mbps 400 --rounds 3 --steps 8 | tee "$out/overlap.txt"
echo "== checkpoint (sharded save and load against plain write and read of the same bytes)"
build/release/bench/checkpoint --mib 64 --reps 7 | tee "$out/checkpoint.txt"
if [ "$(id -u)" -eq 0 ] && [[ " ${targets[*]} " == *" mpi_collectives "* ]]; then
  echo "== cluster_sharding (train_gpt on 2 simulated hosts x 2 MPI ranks, per link rate and sharding)"
  cmake --build build/release -j "$jobs" --target train_gpt >/dev/null
  bench/cluster_sharding.sh build/release | tee "$out/cluster_sharding.txt"
else
  echo "== cluster_sharding: skipped (needs root to make network namespaces, and MPI)"
fi
echo "== issue 15's table (bench/goals.py: the figures above against their goals)"
python3 bench/goals.py "$out" | tee "$out/goals.txt"
echo "== results in $out/"
