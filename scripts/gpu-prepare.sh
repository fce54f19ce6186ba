#!/usr/bin/env bash
# Makes, on a fresh machine of this project's kind, everything the first GPU call of docs/gpu.md
# ("Running the GPU checks") carries, and checks that it fits one call: the staged dependencies
# (.gpu-deps), NCCL 2.30.7 built for the lent GPU (build/nccl), llm.c's trainer (build/llmc) and
# the CUDA build (build/gpu). The machines are fresh each session, so a session that is lent a GPU
# runs this first, then makes its device calls. On 2 cores (2026-12-07, from the tool library's
# fetched sources, beside another build): NCCL 18 minutes, llm.c 1.5, the CUDA build 9; the carry
# 47 MiB of 64.
#
#   scripts/gpu-prepare.sh NCCL_SOURCE [LLMC_SOURCE]
#
# NCCL_SOURCE: github.com/NVIDIA/nccl, a checkout or a git directory holding the tag v2.30.7-1 (the
# tool library's fetch gives one); LLMC_SOURCE: github.com/karpathy/llm.c (without it the llmc
# stage records a skip). Neither is part of this repository.
set -euo pipefail
nccl_src=${1:?usage: scripts/gpu-prepare.sh NCCL_SOURCE [LLMC_SOURCE]}
llmc_src=${2:-}
cd "$(dirname "$0")/.."
root=$PWD
nccl_tag=v2.30.7-1
start=$(date +%s)
step() { echo "== gpu-prepare: $* (at $(($(date +%s) - start)) s)"; }

step "the build's dependencies (scripts/setup.sh, scripts/gpu-deps.sh)"
source scripts/setup.sh
scripts/gpu-deps.sh

# Once built (18 minutes here), NCCL is kept: a second run after a failed later step skips it.
if grep -qs '^#define NCCL_VERSION_CODE 23007$' build/nccl/include/nccl.h && [ -e build/nccl/lib/libnccl.so.2 ]; then
  step "NCCL $nccl_tag: built already (build/nccl)"
else
  step "NCCL $nccl_tag (scripts/build-nccl.sh)"
  git -C "$nccl_src" rev-parse -q --verify "$nccl_tag^{commit}" >/dev/null ||
    { echo "gpu-prepare: $nccl_src has no tag $nccl_tag" >&2; exit 1; }
  rm -rf build/nccl-src
  mkdir -p build/nccl-src
  git -C "$nccl_src" archive "$nccl_tag" | tar -x -C build/nccl-src
  scripts/build-nccl.sh build/nccl-src
fi

if [ -n "$llmc_src" ]; then
  step "llm.c (scripts/build-llmc.sh)"
  scripts/build-llmc.sh "$llmc_src"
fi

step "the CUDA build (gpu-check.sh's configure, build and prune stages)"
# gpu-check's budgets are a device call's (600 s); a fresh build here takes longer on 2 cores.
BUDGET_S=3600 BUILD_TIMEOUT=3000 STAGES="configure build prune" OUT=out/gpu-build scripts/gpu-check.sh
grep -q '^GPT_CUDNN_FRONTEND_INCLUDE_DIR:PATH=/' build/gpu/CMakeCache.txt ||
  { echo "gpu-prepare: build/gpu was configured without cuDNN's frontend: every --attention cudnn run would refuse" >&2; exit 1; }

# What the call carries: these, and the repository's tracked and untracked files (64 MiB in all).
carry=(.gpu-deps build/gpu build/nccl)
[ -x build/llmc/train_gpt2cu ] && carry+=(build/llmc)
repo_kib=$(git ls-files -co --exclude-standard -z | du -ck --files0-from=- | tail -1 | cut -f1)
carry_kib=$(du -sck "${carry[@]}" | tail -1 | cut -f1)
total_mib=$(((repo_kib + carry_kib + 1023) / 1024))
du -sh "${carry[@]}"
echo "gpu-prepare: the carry with the repository is $total_mib MiB of 64 ($(($(date +%s) - start)) s)"
[ "$total_mib" -le 64 ] || { echo "gpu-prepare: over the 64 MiB a device call carries: leave build/llmc out" >&2; exit 1; }
printf 'carry: [%s]\n' "$(printf '"%s", ' "${carry[@]}" | sed 's/, $//')"
