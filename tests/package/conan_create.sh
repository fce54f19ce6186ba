#!/usr/bin/env bash
# The Conan 2 package, offline: `conan create packaging/conan` with a fresh Conan home in WORK
# and ConanCenter disabled (the recipe needs nothing from a remote), which installs fsdp into the
# Conan cache and builds and runs packaging/conan/test_package (the consumer program of
# tests/package) against it. Conan comes from scripts/setup.sh (.pydeps/conan).
#   conan_create.sh SOURCE_DIR WORK
set -euo pipefail
src=$1 work=$2
export PYTHONPATH="$src/.pydeps/conan" CONAN_HOME="$work/conan_home"
conan() { python3 "$src/.pydeps/conan/bin/conan" "$@"; }
rm -rf "$CONAN_HOME"
conan profile detect >/dev/null 2>&1
conan remote disable conancenter >/dev/null
conan create "$src/packaging/conan" -s compiler.cppstd=20 -s build_type=Release
# The package holds the headers and fsdp's own package config, components included.
ref=$(conan list 'fsdp/*#latest:*' --format=json | python3 -c '
import json, sys
for name, r in json.load(sys.stdin)["Local Cache"].items():
    for rev, v in r["revisions"].items():
        print(name + "#" + rev + ":" + next(iter(v["packages"])))')
pkg=$(conan cache path "$ref")
for f in include/fsdp/fsdp.hpp lib/cmake/fsdp/fsdpConfig.cmake lib/cmake/fsdp/fsdpConfigVersion.cmake lib/cmake/fsdp/fsdpMpiTargets.cmake; do
  [ -f "$pkg/$f" ] || { echo "conan_create: the package lacks $f"; exit 1; }
done
echo "conan_create: PASS (package $pkg)"
