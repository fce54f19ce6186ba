# Finds what fsdp::fsdp links: the CUDA toolkit's headers (bf16/f16 types), CCCL (Thrust, run on
# the host through Thrust's CPP system), threads, nlohmann-json and xxHash. Shared by the build and the installed
# package config (where a missing dependency makes find_package(fsdp) report "not found").
if(CMAKE_FIND_PACKAGE_NAME)
  include(CMakeFindDependencyMacro)
  macro(_fsdp_find)
    find_dependency(${ARGV})
  endmacro()
else()
  macro(_fsdp_find)
    find_package(${ARGV} REQUIRED)
  endmacro()
endif()
_fsdp_find(Threads)
_fsdp_find(CUDAToolkit)
# fsdp runs Thrust on the host unless told otherwise (-DCCCL_THRUST_DEVICE_SYSTEM=OMP, say). A
# cache entry, created before CCCL's own: a plain variable here left CCCL to cache its default
# (CUDA) on the first configure, and the second configure then built host code for CUDA.
set(CCCL_THRUST_DEVICE_SYSTEM CPP CACHE STRING "Thrust device system for fsdp's host code (CPP, OMP, TBB)")
# A build directory configured before that fix still caches CUDA, which host code must not use.
if(CCCL_THRUST_DEVICE_SYSTEM STREQUAL "CUDA")
  message(WARNING "fsdp: CCCL_THRUST_DEVICE_SYSTEM=CUDA is not a device system for host code (cached by an "
                  "older fsdp configure); using CPP")
  set(CCCL_THRUST_DEVICE_SYSTEM CPP CACHE STRING "Thrust device system for fsdp's host code (CPP, OMP, TBB)" FORCE)
endif()
_fsdp_find(CCCL CONFIG HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake" "${CUDAToolkit_TARGET_DIR}/lib64/cmake")
# nlohmann-json (header-only, Debian's nlohmann-json3-dev): checkpoint headers and indexes. A
# well-kept parser instead of one of our own; its CMake package gives nlohmann_json::nlohmann_json.
_fsdp_find(nlohmann_json 3.10 CONFIG)
# xxHash (header-only, Debian's libxxhash-dev): shard_group checksums replicas' initial values,
# checkpoints every chunk they write.
find_path(FSDP_XXHASH_INCLUDE_DIR xxhash.h)
if(NOT FSDP_XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR "fsdp needs xxHash's header xxhash.h (Debian: apt-get install libxxhash-dev)")
endif()
