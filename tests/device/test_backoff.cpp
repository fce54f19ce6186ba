// Tests of detail::backoff (detail/backoff.hpp), the pause between two polls of the CUDA
// device's waits, NCCL's non-blocking calls and the MPI engine.

#include "fsdp/detail/backoff.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <vector>

namespace {

using namespace std::chrono_literals;
using fsdp::detail::backoff;
using step = backoff::step;

std::vector<step> pauses(backoff& b, int n) {
  std::vector<step> out;
  for (int i = 0; i < n; ++i) out.push_back(b.pause());
  return out;
}

}  // namespace

TEST_CASE("backoff yields for the first `yields` pauses, then sleeps") {
  backoff b{3, 0us};
  CHECK(pauses(b, 5) == std::vector{step::yield, step::yield, step::yield, step::sleep, step::sleep});
}

TEST_CASE("backoff: reset() starts the yields again") {
  backoff b{2, 0us};
  CHECK(pauses(b, 3) == std::vector{step::yield, step::yield, step::sleep});
  b.reset();
  CHECK(pauses(b, 3) == std::vector{step::yield, step::yield, step::sleep});
  b.pause();
  b.reset();  // reset in the middle of the yields too
  CHECK(b.pause() == step::yield);
}

TEST_CASE("backoff: the count saturates, so a long wait never goes back to yielding") {
  backoff b{1, 0us};
  CHECK(b.pause() == step::yield);
  int sleeps = 0;
  for (int i = 0; i < 100'000; ++i) sleeps += b.pause() == step::sleep;
  CHECK(sleeps == 100'000);
}

TEST_CASE("backoff: no yields sleeps at once, for at least the sleep") {
  backoff b{0, 2ms};
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(b.pause() == step::sleep);
  CHECK(std::chrono::steady_clock::now() - t0 >= 2ms);
}

TEST_CASE("backoff: the settings of its callers") {
  // Changing them changes how fast a rank notices completions and how much CPU it burns while
  // waiting (see detail/backoff.hpp): it should be a deliberate change.
  constexpr backoff device = backoff::device_wait();
  CHECK(device.yields() == 200);
  CHECK(device.sleep() == 50us);
  constexpr backoff mpi = backoff::mpi_progress();
  CHECK(mpi.yields() == 63);
  CHECK(mpi.sleep() == 20us);
}
