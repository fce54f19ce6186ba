# Finds what fsdp::fsdp links: the CUDA toolkit's headers (bf16/f16 types), CCCL (Thrust, run on
# the host through Thrust's CPP system) and threads. Shared by the build and the installed
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
if(NOT DEFINED CCCL_THRUST_DEVICE_SYSTEM)
  set(CCCL_THRUST_DEVICE_SYSTEM CPP)  # fsdp runs Thrust on the host unless told otherwise
endif()
_fsdp_find(CCCL CONFIG HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake" "${CUDAToolkit_TARGET_DIR}/lib64/cmake")
