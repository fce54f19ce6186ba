#!/usr/bin/env bash
# Builds llm.c's GPT-2 trainer (train_gpt2cu, with cuDNN's flash attention, for sm_90) into
# build/llmc, where gpu-check.sh's llmc stage finds it (docs/gpu.md, "llm.c on the same GPU"):
# issue 36's peer, llm.c's own figure on the same card.
#
#   scripts/build-llmc.sh SOURCE   # SOURCE: a checkout of github.com/karpathy/llm.c, or its git
#                                  # directory (the tool library's fetch gives one; commit f1e2ace
#                                  # is the one built on 2026-11-29)
#
# Not part of the build or the tests: nothing of llm.c is in this repository, and this machine has
# no network to fetch it. About a minute on 2 cores; 3.2 MB. Without a GPU the program stops with
# "CUDA driver version is insufficient".
set -euo pipefail
src=${1:?usage: scripts/build-llmc.sh LLMC_SOURCE_OR_GIT_DIR}
cd "$(dirname "$0")/.."
root=$PWD
source scripts/setup.sh >/dev/null  # .pydeps/cudnn-frontend: the cuDNN frontend llm.c includes
work=$root/build/llmc-src  # llm.c's sources, copied (they are patched below)
out=$root/build/llmc
rm -rf "$work"
mkdir -p "$work" "$out"
if git -C "$src" rev-parse -q --verify HEAD >/dev/null 2>&1; then  # a checkout or a git directory: its HEAD
  git -C "$src" archive HEAD | tar -x -C "$work"
else
  cp -r "$src"/. "$work"
fi
cd "$work"
# CUDA 13's cudaMemAdvise takes a cudaMemLocation where CUDA 12's took a device number (llm.c's
# out-of-memory fallback to managed memory, its only use): the host as a location.
sed -i 's/cudaMemAdvise(\*out, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, cudaMemLocation{cudaMemLocationTypeHost, 0})/' llmc/cuda_utils.cuh
grep -q 'cudaMemLocation{cudaMemLocationTypeHost, 0}' llmc/cuda_utils.cuh || { echo "build-llmc: llmc/cuda_utils.cuh's cudaMemAdvise call not found to adapt for CUDA 13" >&2; exit 1; }
ln -sfn "$root/.pydeps/cudnn-frontend" cudnn-frontend  # the Makefile looks for ./cudnn-frontend/include
# NVCC_LDFLAGS on the command line replaces the Makefile's: the frontend 1.32 calls NVRTC and the
# driver (the toolkit's stub here; the GPU machine's driver there), and NVML, which the Makefile
# links but llm.c uses only where nvml.h is, is not on this machine.
cuda=${CUDA_HOME:-/usr/local/cuda}
make train_gpt2cu USE_CUDNN=1 NO_MULTI_GPU=1 NO_USE_MPI=1 GPU_COMPUTE_CAPABILITY=90 \
  NVCC_LDFLAGS="-lcublas -lcublasLt -lcudnn -lnvrtc -L$cuda/lib64/stubs -lcuda" >"$out/build.log" 2>&1 ||
  { tail -20 "$out/build.log" >&2; exit 1; }
cp train_gpt2cu "$out/train_gpt2cu"
echo "build-llmc: $out/train_gpt2cu ($(du -h "$out/train_gpt2cu" | cut -f1)) from llm.c $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '(not from git)')"
