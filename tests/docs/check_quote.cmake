# Passes when DOC contains SOURCE verbatim (a program a page quotes must be the one the tests
# build and run).   cmake -DDOC=docs/guide.md -DSOURCE=examples/train_tiny.cpp -P check_quote.cmake
file(READ ${DOC} doc)
file(READ ${SOURCE} source)
string(FIND "${doc}" "${source}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${DOC} does not quote ${SOURCE} as it is: copy the file into its code block again")
endif()
message("check_quote: ${DOC} quotes ${SOURCE}")
