#!/usr/bin/env bash
# The main job: builds train_gpt and trains a small GPT on English text (Debian's fortunes),
# sharded over 4 thread ranks (full sharding), about a minute on 2 cores. It prints a line per
# step (loss, tokens/s, per-rank peak memory, bytes sent, time waiting on communication), the
# validation loss every 25 steps, and per-rank memory against an unsharded run.
# Extra arguments go to the program (--help lists them), e.g.:
#   scripts/run-example.sh --sharding hybrid:2 --precision bf16 --trace trace.json --loss-plot loss.svg
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=OFF -DFSDP_NATIVE_ARCH=ON >/dev/null
cmake --build build/release --target train_gpt
exec ./build/release/examples/train_gpt --ranks 4 "$@"
