#!/usr/bin/env bash
# The main job: builds the example and trains a multi-layer model sharded over 4 thread ranks
# (full sharding), printing per-step loss, per-rank peak memory and bytes sent.
# Extra arguments go to the program, e.g.: scripts/run-example.sh --sharding hybrid:2 --precision bf16
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=OFF >/dev/null
cmake --build build/release --target train_mlp
exec ./build/release/examples/train_mlp --ranks 4 "$@"
