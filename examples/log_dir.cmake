# train_gpt --log-dir on thread ranks: a run stopped by a loss that is not finite leaves each
# rank's log in DIR, rank_0.log with the process's lines (the steps, the final error) and
# rank_1.log with rank 1's own cause.
#   cmake -DPROGRAM=path/to/train_gpt -DDIR=scratch -P log_dir.cmake
file(REMOVE_RECURSE "${DIR}")
execute_process(COMMAND "${PROGRAM}" --ranks 2 --steps 5 --layers 1 --dim 16 --seq 16 --batch 4 --lr 1e30 --eval-every 0
                        --log-dir "${DIR}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "log_dir: exit status '${rc}', expected 1")
endif()
if(NOT err MATCHES "every rank's log is in ${DIR} [(]rank_<r>.log[)]")
  message(FATAL_ERROR "log_dir: the error does not say where the logs are")
endif()
function(expect_log rank regex)
  if(NOT EXISTS "${DIR}/rank_${rank}.log")
    message(FATAL_ERROR "log_dir: no ${DIR}/rank_${rank}.log")
  endif()
  file(READ "${DIR}/rank_${rank}.log" log)
  if(NOT log MATCHES "${regex}")
    message(FATAL_ERROR "log_dir: rank_${rank}.log does not match '${regex}':\n${log}")
  endif()
endfunction()
expect_log(0 "step +0 [|] loss")
expect_log(0 "train_gpt: step [0-9]+: loss is nan")
expect_log(1 "^rank 1: step [0-9]+: loss is nan")
file(REMOVE_RECURSE "${DIR}")
message("log_dir: both ranks' logs hold their lines")
