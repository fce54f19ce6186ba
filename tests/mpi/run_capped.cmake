# Runs CMD (arguments separated by |) for at most 30 s and prints what it printed: the caller's
# PASS_REGULAR_EXPRESSION decides. (ctest fails a killed test whatever its output.) Each of
# EXPECT_1, EXPECT_2, ... that is given must match the output too (one line each, in any order,
# as ranks print in any order); the script prints "run_capped: all expected lines" when they do.
string(REPLACE "|" ";" cmd "${CMD}")
execute_process(COMMAND timeout -k 5 30 ${cmd} OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 45)
message("${out}${err}")
# A sanitizer's report fails the test even when the expected lines are there.
if("${out}${err}" MATCHES "ERROR: AddressSanitizer|WARNING: ThreadSanitizer|runtime error:")
  message(FATAL_ERROR "run_capped: a sanitizer reported an error")
endif()
set(missing "")
foreach(i RANGE 1 9)
  if(DEFINED EXPECT_${i} AND NOT "${out}${err}" MATCHES "${EXPECT_${i}}")
    string(APPEND missing "\n  ${EXPECT_${i}}")
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "run_capped: no line matches${missing}")
endif()
message("run_capped: all expected lines")
