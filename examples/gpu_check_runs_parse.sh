#!/usr/bin/env bash
# example.gpu_check.runs_parse: the first GPU call docs/gpu.md prepares ("Running the GPU
# checks"), run where there is no GPU. Every train_gpt run of its gpt, nccl, ab, curve and profile
# stages must get through train_gpt's options and their checks and stop only at the device (exit
# 1, "no device"): a renamed option or a refused combination (exit 2) would otherwise show first on
# the lent GPU, in the one call a session gets.
# Usage, from the repository root: examples/gpu_check_runs_parse.sh BUILD_DIR
set -uo pipefail
build=$1
if nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check_runs_parse: skipped: a GPU is here, where these runs would train (gpu-check.sh runs them)"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# The first call's settings that reach train_gpt (the A/B variants and the curves' fast paths are
# gpu-check.sh's defaults); the stages that run no train_gpt are left out.
STAGES="gpt nccl curve profile ab" BUILD_DIR=$build OUT=$out GPT_RUNS="1:full 4:full 4:none" \
  NCCL_RUNS="4:full:threads 4:full:threads:registered 4:none:threads" \
  GPT_EXTRA_ARGS="--attention cudnn --elementwise fused" AB_ROUNDS=1 \
  PROFILE_ARGS="--attention cudnn --elementwise fused" PROFILE_NCU=0 \
  bash scripts/gpu-check.sh >"$out/run.txt" 2>&1
# The runs docs/gpu.md counts for this call: fewer means a stage ran nothing (a renamed variable).
expected_runs=21
cat "$out"/gpt.log "$out"/profile.txt 2>/dev/null >"$out/all.log"
runs=$(grep -cE '^### [^ ]+: exit ' "$out/all.log")
stopped=$(grep -cE '^### [^ ]+: exit 1$' "$out/all.log")
no_device=$(grep -c 'fsdp: no device' "$out/all.log")
echo "gpu_check_runs_parse: $runs train_gpt runs, $stopped ended with exit 1, $no_device at the missing device"
if [ "$runs" -lt "$expected_runs" ] || [ "$stopped" -ne "$runs" ] || [ "$no_device" -ne "$runs" ]; then
  grep -E '^### [^ ]+: exit [^1]' "$out/all.log"   # the runs that did not stop at the device
  grep -E '^train_gpt: --' "$out/all.log" | sort | uniq -c   # what train_gpt refused
  tail -30 "$out/run.txt"
  exit 1
fi
echo "gpu_check_runs_parse: every run got past train_gpt's options"
