# fsdp writes ours.safetensors; Python's safetensors checks it and writes theirs.safetensors;
# fsdp checks that. Then fsdp exports a sharded model's full parameters (f32 and bf16) and
# Python's safetensors reads them and compares them with the gathered model (export_check.py).
# Each step fails the test with its own message.
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
step(${SAMPLE} export export)
step(${CMAKE_COMMAND} -E env PYTHONPATH=${PYDEPS} ${PYTHON} ${EXPORT_SCRIPT} export)
message("interop: fsdp read python's file")
