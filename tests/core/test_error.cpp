// Tests of fsdp::error (core/error.hpp): the what() format, the accessors, the categories.

#include "fsdp/core/error.hpp"

#include <doctest/doctest.h>

#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

TEST_CASE("error: what() names category, site and message") {
  using fsdp::errc;
  const fsdp::error full(errc::timeout, "waited 300 ms for all_gather", {3, 2, "w1"});
  CHECK(std::string(full.what()) == "fsdp: timeout: [rank 3, unit 2, parameter 'w1'] waited 300 ms for all_gather");

  CHECK(std::string(fsdp::error(errc::invalid_argument, "bad shape").what()) ==
        "fsdp: invalid argument: bad shape");
  CHECK(std::string(fsdp::error(errc::mismatch, "m", {0}).what()) == "fsdp: mismatch across ranks: [rank 0] m");
  CHECK(std::string(fsdp::error(errc::order, "o", {-1, 4}).what()) == "fsdp: hooks out of order: [unit 4] o");
  CHECK(std::string(fsdp::error(errc::checkpoint, "c", {-1, -1, "b2"}).what()) ==
        "fsdp: checkpoint: [parameter 'b2'] c");
  CHECK(std::string(fsdp::error(errc::peer_failure, "p", {1, -1, "g"}).what()) ==
        "fsdp: peer failure: [rank 1, parameter 'g'] p");
  CHECK(std::string(fsdp::error(errc::unsupported_dtype, "u", {-1, 0}).what()) ==
        "fsdp: unsupported dtype: [unit 0] u");
  // An explicitly empty site is no site: no brackets at all.
  const std::string none = fsdp::error(errc::internal, "x", fsdp::error_site{}).what();
  CHECK(none == "fsdp: internal error: x");
  CHECK(none.find('[') == std::string::npos);
}

TEST_CASE("error: accessors return the code and the site") {
  using fsdp::errc;
  const fsdp::error e(errc::no_device, "no CUDA device", {5, 7, "layer.3.weight"});
  CHECK(e.code() == errc::no_device);
  CHECK(e.rank() == 5);
  CHECK(e.unit() == 7);
  CHECK(e.param() == "layer.3.weight");

  const fsdp::error plain(errc::checkpoint, "truncated");
  CHECK(plain.code() == errc::checkpoint);
  CHECK(plain.rank() == -1);
  CHECK(plain.unit() == -1);
  CHECK(plain.param().empty());

  // Copies (as std::exception_ptr makes them) keep everything.
  const fsdp::error copy = e;
  CHECK(copy.code() == errc::no_device);
  CHECK(copy.param() == "layer.3.weight");
  CHECK(std::string(copy.what()) == e.what());
}

TEST_CASE("error: is a std::runtime_error and survives an exception_ptr") {
  std::exception_ptr p;
  try {
    throw fsdp::error(fsdp::errc::mismatch, "ranks disagree", {2});
  } catch (...) {
    p = std::current_exception();
  }
  REQUIRE(p);
  try {
    std::rethrow_exception(p);
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "fsdp: mismatch across ranks: [rank 2] ranks disagree");
    const auto* fe = dynamic_cast<const fsdp::error*>(&e);
    REQUIRE(fe != nullptr);
    CHECK(fe->code() == fsdp::errc::mismatch);
    CHECK(fe->rank() == 2);
  }
}

TEST_CASE("errc: every category has its own name") {
  using fsdp::errc;
  const std::pair<errc, std::string_view> names[] = {
      {errc::invalid_argument, "invalid argument"},
      {errc::mismatch, "mismatch across ranks"},
      {errc::order, "hooks out of order"},
      {errc::unsupported_dtype, "unsupported dtype"},
      {errc::timeout, "timeout"},
      {errc::peer_failure, "peer failure"},
      {errc::no_device, "no device"},
      {errc::checkpoint, "checkpoint"},
      {errc::non_finite, "non-finite value"},
      {errc::internal, "internal error"},
  };
  for (const auto& [c, name] : names) {
    CHECK(fsdp::to_string(c) == name);
    CHECK(std::string(fsdp::error(c, "m").what()) == "fsdp: " + std::string(name) + ": m");
  }
}
