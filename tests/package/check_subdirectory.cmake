# Configures, builds and runs tests/package/subdirectory (fsdp through add_subdirectory) in
# WORK_DIR; fails when fsdp configured its own tests, examples or benchmarks as a subproject.
#   cmake -DFSDP_SOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX_COMPILER=... -P check_subdirectory.cmake
# -DPROJECT=<folder of tests/package> takes another consumer (default: subdirectory);
# -DCONFIGURE_ONLY=ON stops after the configure.
cmake_minimum_required(VERSION 3.25)
if(NOT PROJECT)
  set(PROJECT subdirectory)
endif()
set(build ${WORK_DIR}/build)
file(REMOVE_RECURSE ${build})
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "check_subdirectory: ${what} failed (exit ${result}):\n${out}")
  endif()
  message("${out}")
endfunction()
step(configure ${CMAKE_COMMAND} -S ${FSDP_SOURCE_DIR}/tests/package/${PROJECT} -B ${build} -G ${GENERATOR}
     -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DFSDP_SOURCE_DIR=${FSDP_SOURCE_DIR})
foreach(dir tests examples bench)
  if(EXISTS ${build}/fsdp/${dir})
    message(FATAL_ERROR "check_subdirectory: fsdp configured its ${dir} as a subproject")
  endif()
endforeach()
if(CONFIGURE_ONLY)
  message("check_subdirectory: PASS")
  return()
endif()
step(build ${CMAKE_COMMAND} --build ${build})
step(run ${build}/fsdp_consumer)
message("check_subdirectory: PASS")
