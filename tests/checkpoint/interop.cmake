# fsdp writes ours.safetensors; Python's safetensors checks it and writes theirs.safetensors;
# fsdp checks that. Each step fails the test with its own message.
function(step)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "interop: '${ARGV}' failed (${rc})")
  endif()
endfunction()
step(${SAMPLE} write ours.safetensors)
step(${CMAKE_COMMAND} -E env PYTHONPATH=${PYDEPS} ${PYTHON} ${SCRIPT} ours.safetensors theirs.safetensors)
step(${SAMPLE} check theirs.safetensors)
message("interop: fsdp read python's file")
