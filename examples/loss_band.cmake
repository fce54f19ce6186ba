# scripts/loss_band.py on both sides of its band: train_gpt's f32 curve is the reference; its bf16
# curve (rounding only) must be within the band, and a curve trained with another learning rate
# must not be (loss_band exits 1 for it). The band's own numbers come from these runs.
#
#   cmake -DPROGRAM=train_gpt -DPYTHON=python3 -DSCRIPT=scripts/loss_band.py "-DARGS=--steps|200|--lr|0.001" -P loss_band.cmake
string(REPLACE "|" ";" args "${ARGS}")
foreach(run IN ITEMS "f32;--precision;fp32" "bf16;--precision;bf16" "lr7e-4;--precision;fp32;--lr;0.0007")
  list(POP_FRONT run name)
  file(REMOVE "loss_band_${name}.csv")
  execute_process(COMMAND "${PROGRAM}" ${args} ${run} --loss-csv loss_band_${name}.csv
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 200)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "loss_band: the ${name} run failed (${rc}):\n${out}${err}")
  endif()
endforeach()
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" loss_band_f32.csv loss_band_bf16.csv RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "loss_band: the bf16 curve should be within the band of the f32 one (exit ${rc})")
endif()
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" loss_band_f32.csv loss_band_lr7e-4.csv RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "loss_band: the curve of learning rate 7e-4 should be outside the band of 1e-3's (exit 1), got exit ${rc}")
endif()
message("loss_band: both sides of the band hold")
