# Runs the CUDA example for a few steps (one rank). Passes when it trained (exit 0, the final
# summary printed) or when it stopped cleanly for lack of a GPU: an integer non-zero exit code
# (a crash yields a signal description instead) and the "no CUDA device" message.
#   cmake -DEXE=train_mlp_cuda -DSTORE=dir -P run_example.cmake
execute_process(COMMAND ${EXE} --steps 3 --store ${STORE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc STREQUAL "0" AND out MATCHES "unsharded \\(DDP\\) state per rank")
  message("run_example: PASS: trained")
elseif(rc MATCHES "^[1-9][0-9]*$" AND err MATCHES "no CUDA device")
  message("run_example: PASS: stopped with 'no CUDA device' (exit ${rc})")
else()
  message(FATAL_ERROR "run_example: FAIL: exit '${rc}'")
endif()
