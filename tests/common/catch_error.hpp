#pragma once
// catch_error(f): runs f, returns the fsdp::error it threw; fails the test otherwise.
#include <doctest/doctest.h>

#include <exception>

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

}  // namespace fsdp_test
