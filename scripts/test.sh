#!/usr/bin/env bash
# Builds and runs the whole test suite:
#   1. every test (unit, property, parity, accounting, bad input, package, compile checks)
#      in an optimized build with assertions,
#   2. the threads-backend tests again under ThreadSanitizer,
#   3. the runtime tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
jobs=${FSDP_JOBS:-$(nproc)}

build() {  # build DIR CMAKE_ARGS... : configure and build every target
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

echo "== tests (RelWithDebInfo)"
build build/test -DCMAKE_BUILD_TYPE=RelWithDebInfo
ctest --test-dir build/test --output-on-failure -j "$jobs"

echo "== ThreadSanitizer: queues, threads communicator, shard_group, optimizers"
build build/tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFSDP_SANITIZE=thread -DFSDP_BUILD_EXAMPLES=OFF
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --test-dir build/tsan --output-on-failure -j "$jobs" -L "device|comm|group|optim"

echo "== AddressSanitizer + UBSan: runtime tests"
build build/asan -DCMAKE_BUILD_TYPE=Debug -DFSDP_SANITIZE=address -DFSDP_BUILD_EXAMPLES=OFF
ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="print_stacktrace=1" \
  ctest --test-dir build/asan --output-on-failure -j "$jobs" -L "core|device|comm|group|optim"
