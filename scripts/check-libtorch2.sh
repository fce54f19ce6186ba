#!/usr/bin/env bash
# The LibTorch adapter's tests against LibTorch 2.x, by hand (not in CI: the wheel is 1.2 GB):
# the PyPI `torch` wheel's headers and CPU libraries (no CUDA wheels: --no-deps) into
# $FSDP_TORCH2 (default /tmp/torch2), then tests/libtorch/test_libtorch.cpp compiled and run
# against them with plain g++ flags. Never point CMake at the wheel beside Debian's LibTorch.
#   scripts/check-libtorch2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${FSDP_TORCH2:-/tmp/torch2}
[ -d "$torch/torch/include" ] ||
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$torch" torch
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cuda=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
flags=(-std=gnu++20 -O1 -Wall -Wextra -D_GLIBCXX_USE_CXX11_ABI=1 -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP
       -DTHRUST_HOST_SYSTEM=THRUST_HOST_SYSTEM_CPP -Itests -Iinclude -I"$cuda/include/cccl"
       -isystem "$torch/torch/include" -isystem "$torch/torch/include/torch/csrc/api/include" -isystem "$cuda/include")
echo "== LibTorch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$torch/torch/version.py")"
g++ "${flags[@]}" -c tests/libtorch/test_libtorch.cpp -o "$out/t.o"
g++ "${flags[@]}" -c tests/common/doctest_main.cpp -o "$out/main.o"
g++ "$out/t.o" "$out/main.o" -o "$out/test_libtorch" -L"$torch/torch/lib" -Wl,-rpath,"$torch/torch/lib" \
  -Wl,--no-as-needed -ltorch_cpu -lc10 -Wl,--as-needed -pthread
"$out/test_libtorch"
