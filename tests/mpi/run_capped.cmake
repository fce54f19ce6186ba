# Runs CMD (arguments separated by |) for at most 30 s and prints what it printed: the caller's
# PASS_REGULAR_EXPRESSION decides. (ctest fails a killed test whatever its output.)
string(REPLACE "|" ";" cmd "${CMD}")
execute_process(COMMAND timeout -k 5 30 ${cmd} OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 45)
message("${out}${err}")
