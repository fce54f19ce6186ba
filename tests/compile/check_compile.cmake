# Compiles SOURCE (syntax only) with the command line fsdp::fsdp gives a consumer, read from
# FLAGS_FILE (written by tests/compile/CMakeLists.txt), and checks the outcome:
#   EXPECT=fail     the compiler must fail AND its output must match REGEX
#   EXPECT=succeed  the compiler must succeed (the control case)
# Prints "check_compile: PASS" only when the checks hold; stops with an error otherwise.
#   cmake -DFLAGS_FILE=... -DSOURCE=... -DEXPECT=fail -DREGEX=... -P check_compile.cmake
cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS FLAGS_FILE SOURCE EXPECT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_compile: -D${var}=... is missing")
  endif()
endforeach()
if(NOT EXPECT MATCHES "^(fail|succeed)$")
  message(FATAL_ERROR "check_compile: EXPECT must be 'fail' or 'succeed', not '${EXPECT}'")
endif()
if(EXPECT STREQUAL "fail" AND "${REGEX}" STREQUAL "")
  message(FATAL_ERROR "check_compile: a failing case needs a REGEX to look for")
endif()
include(${FLAGS_FILE})

separate_arguments(cxx_flags UNIX_COMMAND "${CXX_FLAGS}")
set(command ${CXX} ${cxx_flags} ${STD_FLAG} ${OPTIONS})
foreach(kind IN ITEMS DEFINITIONS INCLUDES)
  list(REMOVE_ITEM ${kind} "")  # an empty entry would give a bare -D or -I
  list(REMOVE_DUPLICATES ${kind})
endforeach()
list(TRANSFORM DEFINITIONS PREPEND "-D")
list(TRANSFORM INCLUDES PREPEND "-I")
list(APPEND command ${DEFINITIONS} ${INCLUDES})
list(APPEND command -fsyntax-only -fdiagnostics-color=never ${SOURCE})

# Untranslated diagnostics, so the regex sees the compiler's English.
set(ENV{LC_ALL} C)
set(ENV{LANG} C)
execute_process(COMMAND ${command} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
list(JOIN command " " shown)
message("check_compile: ${shown}\n-- compiler output (exit ${result}) --\n${out}-- end of compiler output --")

if(EXPECT STREQUAL "succeed")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "check_compile: ${SOURCE} should compile but did not (exit ${result})")
  endif()
else()
  if(result EQUAL 0)
    message(FATAL_ERROR "check_compile: ${SOURCE} should fail to compile but compiled")
  endif()
  if(NOT out MATCHES "${REGEX}")
    message(FATAL_ERROR "check_compile: ${SOURCE} failed to compile, but without the expected message:\n  ${REGEX}")
  endif()
endif()
message("check_compile: PASS")
