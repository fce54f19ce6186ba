// Tests of detail::backoff (core/backoff.hpp), the pause between two polls of the CUDA
// device's waits, NCCL's non-blocking calls and the MPI engine.

#include "fsdp/core/backoff.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <thread>
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
  // waiting (see core/backoff.hpp): it should be a deliberate change.
  constexpr backoff device = backoff::device_wait();
  CHECK(device.yields() == 200);
  CHECK(device.sleep() == 50us);
  CHECK(device.long_after() == backoff::never);
  constexpr backoff mpi = backoff::mpi_progress();
  CHECK(mpi.yields() == 63);
  CHECK(mpi.sleep() == 20us);
  CHECK(mpi.long_after() == 100ms);
  CHECK(mpi.long_sleep() == 1000us);
}

TEST_CASE("backoff: once long_after has passed since the first sleep, it sleeps long_sleep") {
  backoff b{1, 0us, 20ms, 3ms};
  CHECK(b.pause() == step::yield);
  CHECK(b.pause() == step::sleep);  // the first sleep starts the clock
  std::this_thread::sleep_for(25ms);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(b.pause() == step::long_sleep);
  CHECK(std::chrono::steady_clock::now() - t0 >= 3ms);
  b.reset();  // a completion: yields, short sleeps, and the clock starts again
  CHECK(b.pause() == step::yield);
  CHECK(b.pause() == step::sleep);
  CHECK(b.pause() == step::sleep);
}

TEST_CASE("backoff: without a long phase a wait never reaches long_sleep") {
  backoff b{0, 0us};
  b.pause();
  std::this_thread::sleep_for(5ms);
  CHECK(b.pause() == step::sleep);
}
