#!/usr/bin/env bash
# Builds NCCL from a source checkout for the lent GPU (sm_90) into build/nccl/lib, small enough to
# carry there (docs/gpu.md, "NCCL ranks as threads"): the lent machines have NCCL 2.28.9, and NCCL
# lets ranks share a GPU from 2.30 on; its newest wheel (nvidia-nccl-cu13, every GPU generation)
# is 305 MB, where a call carries 64 MiB in all.
#
#   scripts/build-nccl.sh SOURCE   # SOURCE: a checkout of github.com/NVIDIA/nccl (tag v2.30.7-1)
#
# Not part of the build or the tests: nothing of NCCL is in this repository, and this machine has
# no network to fetch it; whoever prepares a GPU call gets the source (the tool library's fetch)
# and runs this. About 25 minutes on 2 cores; the result, stripped, is 12 MB.
set -euo pipefail
src=${1:?usage: scripts/build-nccl.sh NCCL_SOURCE_DIR}
cd "$(dirname "$0")/.."
root=$PWD
src=$(cd "$src" && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
obj=$root/build/nccl-obj   # NCCL's objects (large, not carried)
out=$root/build/nccl       # what the call carries: lib/libnccl.so.2 and the header it was built with

# The CUDA toolkit here ships NCCL 2.28's headers in its include/; NCCL's device Makefile puts the
# toolkit's include/ before its own, so one of its host files would read 2.28's nccl_device/
# headers and fail. The toolkit's include/ without them:
inc=$obj/cuda-include
mkdir -p "$inc"
for e in "$cuda"/include/*; do
  case ${e##*/} in nccl*) ;; *) ln -sfn "$e" "$inc/${e##*/}" ;; esac
done

# Only what can run on the lent machine, one GPU: the reductions fsdp issues (comm/nccl/
# communicator.hpp: sum and avg, which NCCL runs as Sum, PreMulSum for floats and SumPostDiv for
# integers) of the types it sends (core/dtype.hpp: f32, f64, bf16, f16, i32, i64, u8; NCCL sums
# signed integers with the unsigned kernels), in the algorithms NCCL can choose on one GPU (ring and
# tree; PAT for one rank a host, the processes with their own NCCL_HOSTID), every protocol.
# Left out: NVLS (multicast across GPUs, which NCCL also turns off when ranks share a GPU) and
# CollNet (a network plugin, off by default). A function filtered out becomes a kernel that does
# nothing, so this build is for one GPU only; with every algorithm it is 18 MB, where a call
# carries 64 MiB in all. Gathers, broadcasts and send/recv are built whole.
funcs="AllGather * *|AllGatherV * *|Broadcast * *|SendRecv|(AllReduce|ReduceScatter|Reduce) (Sum|PreMulSum|SumPostDiv) (i8|u8|i32|u32|i64|u64|f16|f32|f64|bf16) (TREE|RING|PAT) *"
# NCCL generates its kernels' sources from ONLY_FUNCS once: generate them again, in case it changed.
rm -rf "$obj/obj/device/gensrc"
make -C "$src" -j"$(nproc)" src.build BUILDDIR="$obj" CUDA_HOME="$cuda" CUDA_INC="$inc" \
  NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" ONLY_FUNCS="$funcs"

real=$(basename "$(readlink -f "$obj/lib/libnccl.so.2")")   # libnccl.so.2.30.7
rm -rf "$out"
mkdir -p "$out/lib" "$out/include"
cp "$obj/lib/$real" "$out/lib/$real"
strip --strip-unneeded "$out/lib/$real"   # the host code's symbols and debug info: 37 MB -> 12 MB
ln -s "$real" "$out/lib/libnccl.so.2"
cp "$obj/include/nccl.h" "$out/include/"
echo "build-nccl: $out/lib/$real ($(du -h "$out/lib/$real" | cut -f1)) from $src ($(git -C "$src" describe --tags 2>/dev/null || echo '?'))"
