# Installs the fsdp build tree FSDP_BUILD_DIR into WORK_DIR/prefix, then configures, builds and
# runs the consumer project against that prefix. Any failing step stops with an error.
#   cmake -DFSDP_BUILD_DIR=... -DCONSUMER_SOURCE_DIR=... -DWORK_DIR=... -DCONFIG=...
#         -DGENERATOR=... -DCXX_COMPILER=... -DCTEST=... [-DMAKE_PROGRAM=...
#         -DGENERATOR_PLATFORM=... -DGENERATOR_TOOLSET=...] -P check_package.cmake
cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS FSDP_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER CTEST)
  if("${${var}}" STREQUAL "")
    message(FATAL_ERROR "check_package: -D${var}=... is missing")
  endif()
endforeach()

set(prefix ${WORK_DIR}/prefix)
set(build ${WORK_DIR}/consumer-build)
# Start clean: a stale prefix or cache could hide a broken install.
file(REMOVE_RECURSE ${prefix} ${build})

# Runs one step, echoing its command; stops with the step's output when it fails.
function(step what)
  list(JOIN ARGN " " shown)
  message("check_package: ${what}: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
  message("${out}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "check_package: ${what} failed (exit ${result})")
  endif()
endfunction()

set(config_args)
if(NOT CONFIG STREQUAL "")
  set(config_args --config ${CONFIG})
endif()

step("install" ${CMAKE_COMMAND} --install ${FSDP_BUILD_DIR} ${config_args} --prefix ${prefix})

set(configure ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${build} -G ${GENERATOR}
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DCMAKE_PREFIX_PATH=${prefix}
  # Only the prefix may provide fsdp, not a package registry entry.
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(NOT CONFIG STREQUAL "")
  list(APPEND configure -DCMAKE_BUILD_TYPE=${CONFIG})
endif()
if(NOT "${MAKE_PROGRAM}" STREQUAL "")
  list(APPEND configure -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
if(NOT "${GENERATOR_PLATFORM}" STREQUAL "")
  list(APPEND configure -A ${GENERATOR_PLATFORM})
endif()
if(NOT "${GENERATOR_TOOLSET}" STREQUAL "")
  list(APPEND configure -T ${GENERATOR_TOOLSET})
endif()
step("configure consumer" ${configure})
# A second configure must keep Thrust on the host: the cache, not a plain variable, holds it.
step("configure consumer again" ${configure})
file(STRINGS ${build}/CMakeCache.txt thrust_system REGEX "^CCCL_THRUST_DEVICE_SYSTEM:")
if(NOT thrust_system MATCHES "=CPP$")
  message(FATAL_ERROR "check_package: after a second configure the consumer's Thrust device system is '${thrust_system}', not CPP")
endif()

# The consumer must have found the fsdp just installed, not another copy.
file(STRINGS ${build}/CMakeCache.txt fsdp_dir REGEX "^fsdp_DIR:")
string(REGEX REPLACE "^fsdp_DIR:[A-Z]+=" "" fsdp_dir "${fsdp_dir}")
file(REAL_PATH "${fsdp_dir}" fsdp_dir)
file(REAL_PATH "${prefix}" real_prefix)
string(FIND "${fsdp_dir}/" "${real_prefix}/" at)
if(NOT at EQUAL 0)
  message(FATAL_ERROR "check_package: the consumer found fsdp in '${fsdp_dir}', not under '${real_prefix}'")
endif()

step("build consumer" ${CMAKE_COMMAND} --build ${build} ${config_args})
step("run consumer" ${CTEST} --test-dir ${build} ${config_args} --output-on-failure --no-tests=error)
# Components: one that does not exist, and one this installation lacks (its targets file removed
# from the prefix, as an fsdp built with FSDP_CUDA=OFF installs it), fail find_package by name.
function(refused components want)
  execute_process(COMMAND ${configure} -B ${WORK_DIR}/refused-build "-DFSDP_COMPONENTS=${components}"
                  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
  file(REMOVE_RECURSE ${WORK_DIR}/refused-build)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}")  # CMake folds long messages
  string(FIND "${flat}" "${want}" at)
  if(result EQUAL 0 OR at EQUAL -1)
    message(FATAL_ERROR "check_package: COMPONENTS ${components} gave (exit ${result}), not '${want}':\n${out}")
  endif()
  message("check_package: COMPONENTS ${components} refused: ${want}")
endfunction()
file(GLOB mpi_targets ${prefix}/lib*/cmake/fsdp/fsdpMpiTargets.cmake)
if(mpi_targets)  # installed with the mpi backend: asking for it must work
  step("configure consumer with COMPONENTS mpi" ${configure} -B ${WORK_DIR}/mpi-build -DFSDP_COMPONENTS=mpi)
  file(REMOVE_RECURSE ${WORK_DIR}/mpi-build)
endif()
refused(bogus "fsdp has no component 'bogus' (it has: mpi, cuda, nccl)")
file(GLOB cuda_targets ${prefix}/lib*/cmake/fsdp/fsdpCudaTargets*.cmake)
file(REMOVE ${cuda_targets})
refused(cuda "fsdp component 'cuda': this fsdp was installed without the CUDA device")
message("check_package: PASS")
