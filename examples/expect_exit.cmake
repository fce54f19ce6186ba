# Runs a program and checks both its exit status and its output (stdout and stderr together),
# which PASS_REGULAR_EXPRESSION alone cannot (it ignores the exit status):
#
#   cmake -DPROGRAM=path/to/train_gpt "-DARGS=--lr|1e30" -DRC=1 "-DMATCH=loss is nan"
#         [-DNO_MATCH=regex] -P expect_exit.cmake
#
# ARGS holds the arguments separated by '|' (a ';' would split the test's command line).
# Passes when the exit status is RC, the output matches MATCH and, if given, not NO_MATCH.
# A test whose outcome depends on the machine (a GPU or none) names the other outcome with
# -DOR_RC=... -DOR_MATCH=...: an exit status of OR_RC with output matching OR_MATCH passes too.
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND "${PROGRAM}" ${args} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
message("${all}")
if(DEFINED OR_RC AND "${rc}" STREQUAL "${OR_RC}")
  set(RC "${OR_RC}")
  set(MATCH "${OR_MATCH}")
endif()
if(NOT "${rc}" STREQUAL "${RC}")
  message(FATAL_ERROR "expect_exit: exit status '${rc}', expected ${RC}")
endif()
if(NOT all MATCHES "${MATCH}")
  message(FATAL_ERROR "expect_exit: the output does not match '${MATCH}'")
endif()
if(DEFINED NO_MATCH AND NOT NO_MATCH STREQUAL "" AND all MATCHES "${NO_MATCH}")
  message(FATAL_ERROR "expect_exit: the output matches '${NO_MATCH}', which it must not")
endif()
message("expect_exit: exit status ${rc}, output as expected")
