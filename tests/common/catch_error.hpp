#pragma once
// catch_error(f): runs f, returns the fsdp::error it threw; fails the test otherwise.
// checkpoint_error(f): the same for an errc::checkpoint, returning its message.
// check_error(f, code, part): f throws an fsdp::error of `code` whose message holds `part`.
#include <doctest/doctest.h>

#include <exception>
#include <string>
#include <utility>

#include "fsdp/core/error.hpp"

namespace fsdp_test {

template <class F>
fsdp::error catch_error(F&& f) {
  try {
    f();
  } catch (const fsdp::error& e) {
    return e;
  } catch (const std::exception& e) {
    FAIL("expected an fsdp::error, got: " << e.what());
  }
  FAIL("expected an fsdp::error, nothing was thrown");
  return fsdp::error(fsdp::errc::internal, "unreachable");
}

template <class F>
void check_error(F&& f, fsdp::errc code, const std::string& part) {
  const fsdp::error e = catch_error(std::forward<F>(f));
  CHECK(e.code() == code);
  CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
}

template <class F>
std::string checkpoint_error(F&& f) {
  const fsdp::error e = catch_error(std::forward<F>(f));
  CHECK(e.code() == fsdp::errc::checkpoint);
  return e.what();
}

}  // namespace fsdp_test
