# scripts/loss_band.py on train_gpt's curves: the run with REFERENCE's options is the reference;
# the run with WITHIN's must be within the band of it, and the run with OUTSIDE's (when given)
# must not be (loss_band exits 1 for it). ARGS are every run's options; each list is '|'-separated.
#
#   cmake -DPROGRAM=train_gpt -DPYTHON=python3 -DSCRIPT=scripts/loss_band.py "-DARGS=--steps|200|--lr|0.001"
#         "-DREFERENCE=--precision|fp32" "-DWITHIN=--precision|bf16" "-DOUTSIDE=--precision|fp32|--lr|0.0007"
#         -DNAME=host -P loss_band.cmake
string(REPLACE "|" ";" args "${ARGS}")
set(runs reference within)
if(DEFINED OUTSIDE)
  list(APPEND runs outside)
endif()
foreach(run IN LISTS runs)
  string(TOUPPER "${run}" var)
  string(REPLACE "|" ";" own "${${var}}")
  set(csv "loss_band_${NAME}_${run}.csv")
  file(REMOVE "${csv}")
  execute_process(COMMAND "${PROGRAM}" ${args} ${own} --loss-csv ${csv}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 250)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "loss_band: the ${run} run (${${var}}) failed (${rc}):\n${out}${err}")
  endif()
endforeach()
execute_process(COMMAND "${PYTHON}" "${SCRIPT}" loss_band_${NAME}_reference.csv loss_band_${NAME}_within.csv
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "loss_band: the curve of ${WITHIN} should be within the band of ${REFERENCE}'s (exit ${rc})")
endif()
if(DEFINED OUTSIDE)
  execute_process(COMMAND "${PYTHON}" "${SCRIPT}" loss_band_${NAME}_reference.csv loss_band_${NAME}_outside.csv
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 1)
    message(FATAL_ERROR "loss_band: the curve of ${OUTSIDE} should be outside the band of ${REFERENCE}'s (exit 1), got exit ${rc}")
  endif()
endif()
message("loss_band: the curves are where they should be")
