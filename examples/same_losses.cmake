# Runs train_gpt twice, on 'threads' ranks and as MPI processes, with the same options, and
# requires the two loss curves (--loss-csv, every loss to the last bit) to be identical: both
# backends sum in rank order (include/fsdp/comm/rank_order_sum.hpp).
#
#   cmake -DPROGRAM=train_gpt -DMPIEXEC=mpiexec -DRANKS=4 "-DARGS=--steps|100" -DNAME=x -P same_losses.cmake
#
# ARGS holds the options separated by '|'. The CSVs are NAME_threads.csv and NAME_mpi.csv.
string(REPLACE "|" ";" args "${ARGS}")
set(threads_csv "${NAME}_threads.csv")
set(mpi_csv "${NAME}_mpi.csv")
file(REMOVE "${threads_csv}" "${mpi_csv}")
execute_process(COMMAND "${PROGRAM}" ${args} --ranks ${RANKS} --loss-csv ${threads_csv}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 200)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "same_losses: the threads run failed (${rc}):\n${out}${err}")
endif()
execute_process(COMMAND "${MPIEXEC}" -n ${RANKS} "${PROGRAM}" ${args} --backend mpi --loss-csv ${mpi_csv}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 200)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "same_losses: the mpi run failed (${rc}):\n${out}${err}")
endif()
file(STRINGS "${threads_csv}" a)
file(STRINGS "${mpi_csv}" b)
list(LENGTH a na)
list(LENGTH b nb)
if(na LESS 2 OR NOT na EQUAL nb)
  message(FATAL_ERROR "same_losses: ${threads_csv} has ${na} lines, ${mpi_csv} has ${nb}")
endif()
math(EXPR last "${na} - 1")
foreach(i RANGE ${last})
  list(GET a ${i} x)
  list(GET b ${i} y)
  if(NOT x STREQUAL y)
    message(FATAL_ERROR "same_losses: line ${i} differs (step,train_loss,val_loss):\n  threads ${x}\n  mpi     ${y}")
  endif()
endforeach()
message("same_losses: ${na} identical lines (header and ${last} steps)")
