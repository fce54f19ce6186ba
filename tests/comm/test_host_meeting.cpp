// examples/common/host_meeting.hpp: the host barrier and first-failure record of NCCL thread
// ranks (common/nccl_thread_ranks.hpp), tested on host threads: its numbered contract.

#include "common/host_meeting.hpp"

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/catch_error.hpp"

namespace {

using namespace std::chrono_literals;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
std::exception_ptr failure(const std::string& what) { return std::make_exception_ptr(std::runtime_error(what)); }

}  // namespace

TEST_CASE("host_meeting: no rank leaves a round before every rank came to it (contract 1)") {
  constexpr int ranks = 3, rounds = 200;
  example::host_meeting meeting{ranks, 20s};
  std::array<std::atomic<int>, rounds> came{};
  std::atomic<int> early{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      for (int k = 0; k < rounds; ++k) {
        if ((k + r) % 7 == 0) std::this_thread::yield();  // ranks arrive in changing orders
        came[static_cast<std::size_t>(k)].fetch_add(1);
        meeting.meet();
        if (came[static_cast<std::size_t>(k)].load() != ranks) early.fetch_add(1);
      }
    });
  for (auto& t : threads) t.join();
  CHECK(early.load() == 0);
  CHECK(meeting.reason().empty());
}

TEST_CASE("host_meeting: a failure ends a waiting meet at once and every later one, naming it (contract 2)") {
  example::host_meeting meeting{2, 20s};
  std::string what;
  fsdp::errc code{};
  double waited = 0;
  std::thread rank0([&] {
    const auto t0 = std::chrono::steady_clock::now();
    const fsdp::error e = fsdp_test::catch_error([&] { meeting.meet(); });
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    what = e.what();
    code = e.code();
  });
  std::this_thread::sleep_for(50ms);
  meeting.fail(1, failure("disk full"));
  rank0.join();
  CHECK(code == fsdp::errc::peer_failure);
  CHECK(contains(what, "rank 1 failed: disk full"));
  CHECK(waited < 10.0);
  const fsdp::error later = fsdp_test::catch_error([&] { meeting.meet(); });
  CHECK(later.code() == fsdp::errc::peer_failure);
}

TEST_CASE("host_meeting: a meet nobody joins ends at the timeout (contract 2)") {
  example::host_meeting meeting{2, 100ms};
  const auto t0 = std::chrono::steady_clock::now();
  const fsdp::error e = fsdp_test::catch_error([&] { meeting.meet(); });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(e.code() == fsdp::errc::timeout);
  CHECK(contains(e.what(), "not every rank came within 100 ms"));
  CHECK(waited >= 0.09);
}

TEST_CASE("host_meeting: the first failure is kept, its words and its exception, and rethrown (contracts 3, 4)") {
  example::host_meeting none{2, 1s};
  CHECK(none.reason().empty());
  CHECK_NOTHROW(none.rethrow_first());

  example::host_meeting meeting{4, 1s};
  meeting.fail(2, failure("out of memory"));
  CHECK(meeting.reason() == "rank 2 failed: out of memory");
  meeting.fail(0, std::make_exception_ptr(fsdp::error(fsdp::errc::peer_failure, "waiting for all_gather: rank 2 failed: out of memory")));
  meeting.fail(3, failure("a different cause"));
  CHECK(meeting.reason() == "rank 2 failed: out of memory");
  CHECK_THROWS_WITH_AS(meeting.rethrow_first(), "out of memory", std::runtime_error);
}

TEST_CASE("host_meeting: refuses a meeting of no ranks") {
  const fsdp::error e = fsdp_test::catch_error([] { example::host_meeting meeting(0, 1s); });
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK(contains(e.what(), "ranks must be >= 1, got 0"));
}
