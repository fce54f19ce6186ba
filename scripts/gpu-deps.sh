#!/usr/bin/env bash
# Stages into .gpu-deps/ (ignored by git) what the CUDA build needs that a lent GPU machine does
# not have, so that the device tool can carry it there (carry [".gpu-deps"]) for
# scripts/gpu-check.sh. Run it here, on a machine of this project's kind (scripts/setup.sh
# installs the Debian packages it copies from). See docs/gpu.md, "Running the GPU checks".
#
# The GPU machine has nvcc, CMake, ninja, the CUDA toolkit (CCCL included) and a Python whose
# pip packages hold NCCL, but no package registry and none of these:
#   doctest        (doctest-dev)         the test framework of every test executable, with its
#                                        CMake package (find_package(doctest), doctest_discover_tests)
#   nlohmann-json  (nlohmann-json3-dev)  checkpoint headers and indexes; fsdp::fsdp links its
#                                        CMake target nlohmann_json::nlohmann_json
#   xxHash         (libxxhash-dev)       xxhash.h (header-only use), checksums of replicas'
#                                        initial values and of checkpoint chunks
#   the fortunes   (fortunes)            the text train_gpt trains on by default (data files only)
# laid out as a CMake prefix: include/, lib/cmake/doctest, share/cmake/nlohmann_json, so that
# -DCMAKE_PREFIX_PATH=$PWD/.gpu-deps finds them; the corpus in share/fortunes.
#
# The staged package configs locate their headers relative to themselves (Debian's doctest
# export hard-codes /usr: it is rewritten), and the script ends by checking that with the system
# prefixes hidden: a CMake probe must find everything under .gpu-deps, and the compiler must
# read no staged header from /usr/include.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-deps

die() { echo "gpu-deps: $*" >&2; exit 1; }
need() {  # need PATH DEBIAN-PACKAGE
  [ -e "$1" ] || die "$1 is missing (Debian: apt-get install $2, or run scripts/setup.sh)"
}
need /usr/include/doctest/doctest.h doctest-dev
need /usr/lib/cmake/doctest/doctestConfig.cmake doctest-dev
need /usr/include/nlohmann/json.hpp nlohmann-json3-dev
need /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake nlohmann-json3-dev
need /usr/include/xxhash.h libxxhash-dev
need /usr/share/games/fortunes fortunes

rm -rf "$dest"
mkdir -p "$dest/include" "$dest/lib/cmake" "$dest/share/cmake" "$dest/share/fortunes" "$dest/share/doc"

# doctest: the header and its CMake package (the config, the exported target, doctest.cmake and
# doctestAddTests.cmake for doctest_discover_tests).
cp -r /usr/include/doctest "$dest/include/"
cp -r /usr/lib/cmake/doctest "$dest/lib/cmake/"
# Debian's doctestTargets.cmake says set(_IMPORT_PREFIX "/usr"): make it the prefix three
# folders above the file (lib/cmake/doctest -> .gpu-deps), as CMake's own exports do.
targets="$dest/lib/cmake/doctest/doctestTargets.cmake"
if grep -q '^set(_IMPORT_PREFIX "/usr")$' "$targets"; then
  # shellcheck disable=SC2016  # ${CMAKE_CURRENT_LIST_DIR} is CMake's, written as it is
  sed -i 's|^set(_IMPORT_PREFIX "/usr")$|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' "$targets"
fi

# nlohmann-json: the whole header tree (json.hpp includes detail/ and thirdparty/) and its CMake
# package, whose export already finds the prefix relative to itself (four folders up).
cp -r /usr/include/nlohmann "$dest/include/"
cp -r /usr/share/cmake/nlohmann_json "$dest/share/cmake/"

# xxHash: header-only use (XXH_INLINE_ALL); xxh3.h only includes xxhash.h. No CMake package:
# fsdp finds it with find_path(xxhash.h), which searches <prefix>/include.
cp /usr/include/xxhash.h /usr/include/xxh3.h "$dest/include/"

# The fortunes' data files, without the index files (*.dat) and the links (*.u8) that
# gpt::load_corpus skips anyway: the same bytes, in the same name order, as the default corpus.
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$dest/share/fortunes/" \;

# Licences and versions.
{
  echo "# .gpu-deps, staged by scripts/gpu-deps.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ) from:"
  for p in doctest-dev nlohmann-json3-dev libxxhash-dev fortunes-min fortunes; do
    v=$(dpkg-query -W -f='${Version}' "$p" 2>/dev/null || true)
    [ -n "$v" ] && echo "$p $v"
    if [ -f "/usr/share/doc/$p/copyright" ]; then
      mkdir -p "$dest/share/doc/$p"
      cp "/usr/share/doc/$p/copyright" "$dest/share/doc/$p/"
    fi
  done
} >"$dest/MANIFEST.txt"

# --- checks -----------------------------------------------------------------------------------
# 1. No staged CMake file names an absolute system path.
if grep -rnE '"/usr[/"]|/usr/(local/)?(include|lib|share)' "$dest/lib/cmake" "$dest/share/cmake"; then
  die "a staged CMake file above names a system path: the prefix is not self-contained"
fi
# 2. The corpus is the default corpus, byte for byte.
want=$(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -print0 | sort -z | xargs -0 cat | sha256sum)
got=$(find "$dest/share/fortunes" -maxdepth 1 -type f -print0 | sort -z | xargs -0 cat | sha256sum)
[ "$want" = "$got" ] || die "the staged corpus differs from /usr/share/games/fortunes"
# 3. CMake finds every package in .gpu-deps with /usr and /usr/local ignored (as prefixes and
# as folders), and every target's include directory is inside it.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
prefix=$(cd "$dest" && pwd)
cat >"$probe/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(gpu_deps_probe LANGUAGES NONE)
find_package(doctest REQUIRED)
include(doctest)  # doctestConfig.cmake puts its folder on CMAKE_MODULE_PATH
find_package(nlohmann_json 3.10 CONFIG REQUIRED)
find_path(PROBE_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
get_target_property(doctest_inc doctest::doctest INTERFACE_INCLUDE_DIRECTORIES)
get_target_property(json_inc nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
foreach(p IN LISTS doctest_DIR nlohmann_json_DIR PROBE_XXHASH_INCLUDE_DIR doctest_inc json_inc)
  cmake_path(IS_PREFIX STAGED "${p}" NORMALIZE inside)
  if(NOT inside)
    message(FATAL_ERROR "gpu-deps probe: '${p}' is not under ${STAGED}")
  endif()
endforeach()
message(STATUS "gpu-deps probe: doctest ${doctest_VERSION} in ${doctest_DIR}; nlohmann_json ${nlohmann_json_VERSION} in ${nlohmann_json_DIR}; xxhash.h in ${PROBE_XXHASH_INCLUDE_DIR}")
EOF
if ! cmake -S "$probe" -B "$probe/build" -DSTAGED="$prefix" -DCMAKE_PREFIX_PATH="$prefix" \
     "-DCMAKE_IGNORE_PREFIX_PATH=/usr;/usr/local;/" \
     "-DCMAKE_IGNORE_PATH=/usr/include;/usr/lib/cmake;/usr/share/cmake;/usr/local/include" \
     -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF \
     >"$probe/log" 2>&1; then
  cat "$probe/log" >&2
  die "CMake cannot find the staged packages with only $prefix"
fi
grep 'gpu-deps probe:' "$probe/log" | sed 's/^-- gpu-deps probe: /gpu-deps: found /'
# 4. A translation unit that includes all three reads no staged header from the system.
if command -v g++ >/dev/null 2>&1; then
  printf '#define XXH_INLINE_ALL\n#include <xxhash.h>\n#include <nlohmann/json.hpp>\n#define DOCTEST_CONFIG_IMPLEMENT\n#include <doctest/doctest.h>\nint main() { return 0; }\n' >"$probe/tu.cpp"
  g++ -std=c++20 -I"$prefix/include" -M "$probe/tu.cpp" >"$probe/deps"
  if grep -E '/usr(/local)?/include/(doctest/|nlohmann/|xxhash\.h|xxh3\.h)' "$probe/deps"; then
    die "a staged header includes the system copy above"
  fi
fi
echo "gpu-deps: staged $(du -sh "$dest" | cut -f1) in $dest ($(find "$dest" -type f | wc -l) files): carry [\".gpu-deps\"], then run scripts/gpu-check.sh"
