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
# loss_band.py on the reference's curve and RUN's, which must exit EXPECTED (0: within, 1: outside).
function(compare run expected where)
  execute_process(COMMAND "${PYTHON}" "${SCRIPT}" loss_band_${NAME}_reference.csv loss_band_${NAME}_${run}.csv
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  string(TOUPPER "${run}" var)
  if(NOT rc EQUAL expected)
    message(FATAL_ERROR "loss_band: the curve of ${${var}} should be ${where} the band of ${REFERENCE}'s (exit ${expected}), got exit ${rc}")
  endif()
endfunction()
compare(within 0 within)
if(DEFINED OUTSIDE)
  compare(outside 1 outside)
endif()
message("loss_band: the curves are where they should be")
