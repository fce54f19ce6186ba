#!/usr/bin/env bash
# Builds and runs the whole test suite:
#   0. the main job's Release build for this CPU (compiler warnings differ by optimization level
#      and target: GCC 12 warns inside AVX-512 intrinsics),
#   1. every test (unit, property, parity, accounting, bad input, package, compile checks)
#      in an optimized build with assertions,
#   2. the runtime tests (checkpoints included), the MPI tests, the fault-injection suite and the main job (train_gpt,
#      threads and MPI) again under ThreadSanitizer,
#   3. the runtime tests, the MPI tests and the main job (train_gpt, threads and MPI) again under
#      AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
jobs=${FSDP_JOBS:-$(nproc)}

stage() { echo "== $* (at ${SECONDS} s)"; }  # the times say where CI's minutes go
configure() {  # configure DIR CMAKE_ARGS...   (warnings are errors in every build the tests make)
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DFSDP_WERROR=ON "$@" >/dev/null
}
# The runtime test executables: what the sanitizer passes rebuild and rerun.
runtime_tests=(test_core test_device test_comm test_group test_optim test_schedule test_checkpoint safetensors_sample)

stage "the main job's build (Release, as scripts/run-example.sh makes it)"
configure build/release -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=OFF -DFSDP_NATIVE_ARCH=ON
cmake --build build/release -j "$jobs" --target train_gpt

stage "tests (RelWithDebInfo)"
configure build/test -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build/test -j "$jobs"
ctest --test-dir build/test --output-on-failure -j "$jobs"

# The MPI programs, the fault-injection suite and the main job, for both sanitizer passes.
mpi_targets=(test_mpi mpi_early_exit mpi_peer_abort mpi_mesh_abort fault_run train_gpt)
# Their tests; the loss-identity runs (same_losses) only in the plain pass, for time.
mpi_tests='^mpi[.]|^faults[.]|^example[.]train_gpt'

stage "ThreadSanitizer: queues, communicators (threads and MPI), shard_group, optimizers, schedule, checkpoints, faults, train_gpt"
configure build/tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFSDP_SANITIZE=thread -DFSDP_BUILD_EXAMPLES=ON -DFSDP_CUDA=OFF
cmake --build build/tsan -j "$jobs" --target "${runtime_tests[@]}" "${mpi_targets[@]}"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
ctest --test-dir build/tsan --output-on-failure -j "$jobs" -L "device|comm|group|optim|schedule|checkpoint"
# Open MPI over shared memory only: its TCP transport (uninstrumented) takes two of its own
# mutexes in both orders in MPI_Init and MPI_Finalize, which TSan reports as a potential
# deadlock in mca_btl_tcp_add_procs. fsdp's tests run on one host and need no TCP; nothing is
# suppressed.
# The faults suite's CPU bound while waiting is for optimized builds: TSan's gets twice the room
# (tests/faults/inject.sh; the optimized pass above checks the real bound).
OMPI_MCA_btl=self,vader FSDP_FAULTS_CPU_BOUND=0.2 ctest --test-dir build/tsan --output-on-failure -j "$jobs" -R "$mpi_tests" -E same_losses
unset TSAN_OPTIONS

stage "AddressSanitizer + UBSan: runtime tests, the GPT model's parity tests, the MPI backend and the main job"
configure build/asan -DCMAKE_BUILD_TYPE=Debug -DFSDP_SANITIZE=address -DFSDP_BUILD_EXAMPLES=ON -DFSDP_CUDA=OFF
cmake --build build/asan -j "$jobs" --target "${runtime_tests[@]}" test_gpt test_parallel test_moe "${mpi_targets[@]}"
ASAN_OPTIONS="detect_leaks=1" UBSAN_OPTIONS="print_stacktrace=1" \
  ctest --test-dir build/asan --output-on-failure -j "$jobs" -L "core|device|comm|group|optim|schedule|checkpoint|gpt"
# MPI processes without leak checking: Open MPI 4.1 keeps process-lifetime allocations in
# plugins it unloads at MPI_Finalize, whose stacks LeakSanitizer cannot name (so no suppression
# can single them out). Address and undefined-behaviour errors are still fatal.
# The faults suite's bounds (report within 1-2 s, CPU while waiting) are for optimized builds.
ASAN_OPTIONS="detect_leaks=0" UBSAN_OPTIONS="print_stacktrace=1" \
  ctest --test-dir build/asan --output-on-failure -j "$jobs" -R "$mpi_tests" -E "same_losses|^faults[.]"
stage "all passed"
