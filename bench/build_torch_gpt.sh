#!/usr/bin/env bash
# examples/libtorch/train_torch_gpt built against the LibTorch inside PyPI's torch wheel, for
# bench/fsdp2_gpt.py (fsdp's adapter and FSDP2 on the very same torch kernels), by hand: CI builds
# the example against Debian's LibTorch 1.13. Plain g++ flags as scripts/check-libtorch2.sh uses
# (never CMake pointed at the wheel beside Debian's LibTorch); -O2 as a Release build.
#   python3 -m pip install --target /tmp/torchfull torch
#   bench/build_torch_gpt.sh /tmp/torchfull        # -> build/torch-wheel/train_torch_gpt
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${1:-${FSDP_TORCH2:-/tmp/torchfull}}
[ -d "$torch/torch/include" ] || { echo "build_torch_gpt: no torch wheel at $torch (pip install --target $torch torch)" >&2; exit 2; }
cuda=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
openblas=()
[ -f /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h ] && openblas=(-I/usr/include/x86_64-linux-gnu/openblas-pthread)
mkdir -p build/torch-wheel
echo "== LibTorch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$torch/torch/version.py")"
g++ -std=gnu++20 -O2 -DNDEBUG -Wall -Wextra -D_GLIBCXX_USE_CXX11_ABI=1 -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP \
  -DTHRUST_HOST_SYSTEM=THRUST_HOST_SYSTEM_CPP -Iinclude -Iexamples -I"$cuda/include/cccl" "${openblas[@]}" \
  -isystem "$torch/torch/include" -isystem "$torch/torch/include/torch/csrc/api/include" -isystem "$cuda/include" \
  examples/libtorch/train_torch_gpt.cpp -o build/torch-wheel/train_torch_gpt \
  -L"$torch/torch/lib" -Wl,-rpath,"$torch/torch/lib" -Wl,--no-as-needed -ltorch_cpu -lc10 -Wl,--as-needed -pthread
echo "build_torch_gpt: build/torch-wheel/train_torch_gpt"
