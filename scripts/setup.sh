#!/usr/bin/env bash
# Installs what building and testing fsdp needs on a fresh Debian 12 machine of this project's
# kind (run as root; installs only what is missing). The CUDA toolkit (nvcc, CCCL, NCCL) is part
# of the machine image; this script checks for it but cannot install it.
set -euo pipefail

# fortunes: the English text the main job (train_gpt) trains on by default. libxxhash-dev:
# xxHash (header-only), the checksum shard_group compares replicas' initial values with.
# nlohmann-json3-dev: the JSON of checkpoint headers and indexes (header-only). python3-pip: the
# Python `safetensors` package, which tests read fsdp's files with (installed below). iproute2:
# `ip` and `tc`, which build the simulated cluster of the multi-host tests (scripts/cluster.sh).
# libopenblas-dev: OpenBLAS, the main job's matrix products (--matmul blas).
# libtorch-dev: LibTorch 1.13.1 for the LibTorch adapter's tests and example (about 2 minutes and
# 510 MB on a fresh machine).
packages=(cmake ninja-build g++ doctest-dev libbenchmark-dev libopenmpi-dev openmpi-bin libxxhash-dev
          nlohmann-json3-dev python3-pip fortunes iproute2 libtorch-dev
          libopenblas-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need root to install: ${missing[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The Python packages of the interoperability tests, into the checkout's .pydeps (not the system's
# Python, which Debian marks as externally managed); tests put it on PYTHONPATH.
pydeps="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.pydeps"
if ! PYTHONPATH="$pydeps" python3 -c "import safetensors, numpy" 2>/dev/null; then
  echo "setup: installing the Python packages safetensors and numpy into $pydeps"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$pydeps" safetensors numpy >/dev/null
fi
# Conan 2 for the package test (tests/package/conan_create.sh), in a folder of its own (pip
# --target would mix its dependencies with the ones above). Pinned: a recipe is checked
# against the Conan it was written for.
if ! PYTHONPATH="$pydeps/conan" python3 -c "import conans, sys; from conan import conan_version; sys.exit(str(conan_version) != '2.34.0')" 2>/dev/null; then
  echo "setup: installing Conan 2.34.0 into $pydeps/conan"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --upgrade --target "$pydeps/conan" conan==2.34.0 >/dev/null
fi

# cuDNN's C++ frontend (header-only, the graph API of its fused attention: train_gpt --device cuda
# --attention cudnn) from PyPI's wheel, only its include/ (3 MB of the 11 MB wheel), into
# .pydeps/cudnn-frontend/include, where examples/CMakeLists.txt looks for it. Pinned: the code is
# written against this version's API.
frontend=1.32.0
if [ "$(cat "$pydeps/cudnn-frontend/VERSION" 2>/dev/null)" != "$frontend" ]; then
  echo "setup: unpacking cuDNN frontend $frontend's headers into $pydeps/cudnn-frontend"
  wheel_dir=$(mktemp -d)
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$wheel_dir" "nvidia-cudnn-frontend==$frontend" >/dev/null
  rm -rf "$pydeps/cudnn-frontend"
  python3 - "$wheel_dir" "$pydeps/cudnn-frontend" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], members=[m for m in z.namelist() if m.startswith("include/")])
PY
  echo "$frontend" > "$pydeps/cudnn-frontend/VERSION"
  rm -rf "$wheel_dir"
fi

if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null 2>&1 || { echo "setup: the CUDA toolkit (nvcc) is not installed; fsdp needs its headers" >&2; exit 1; }
