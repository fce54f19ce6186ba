// The threads backend's all_to_all, send and recv (comm/front.hpp's vocabulary): values against
// plain expectations for N = 1..8, the k-th send matched with the k-th recv, their traffic, and
// their failures (a mismatch, a peer that never sends, a peer that returns, bad peers), each
// bounded in time.
#include "fsdp/comm/threads.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <thread>
#include <vector>

#include "common/catch_error.hpp"

namespace {

using namespace std::chrono_literals;
using fsdp::dtype;
using comm_t = fsdp::threads::communicator;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Rank r's element k of the block it sends to rank j: distinct for every (r, j, k).
float value(int r, int j, std::size_t k) { return static_cast<float>(1000 * r + 100 * j) + static_cast<float>(k); }

// Runs fn on n ranks with a short timeout; returns the failure world::run rethrew (an
// errc::internal "no error" when it returned), and how long it took.
template <class F>
std::pair<fsdp::error, double> failing_run(int n, F fn) {
  const auto start = std::chrono::steady_clock::now();
  const fsdp::error e = fsdp_test::catch_error([&] { fsdp::threads::world{n, {.timeout = 300ms}}.run(fn); });
  return {e, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

}  // namespace

TEST_CASE("all_to_all: block j of rank r's recv is block r of rank j's send, N = 1..8") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    const std::size_t count = 5;
    std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
    std::vector<fsdp::traffic_counters> traffic(static_cast<std::size_t>(n));
    fsdp::threads::world{n}.run([&](comm_t& comm) {
      const int r = comm.rank();
      fsdp::host_queue q;
      std::vector<float> send(count * static_cast<std::size_t>(n)), recv(send.size());
      for (int j = 0; j < n; ++j)
        for (std::size_t k = 0; k < count; ++k) send[static_cast<std::size_t>(j) * count + k] = value(r, j, k);
      comm.all_to_all(send.data(), recv.data(), count, dtype::f32, q).wait(comm.timeout());
      got[static_cast<std::size_t>(r)] = recv;
      traffic[static_cast<std::size_t>(r)] = comm.traffic();
    });
    for (int r = 0; r < n; ++r)
      for (int j = 0; j < n; ++j)
        for (std::size_t k = 0; k < count; ++k)
          REQUIRE(got[static_cast<std::size_t>(r)][static_cast<std::size_t>(j) * count + k] == value(j, r, k));
    fsdp::traffic_counters expect;
    expect.add_all_to_all(count, dtype::f32, n);
    CHECK(traffic[0] == expect);
    CHECK(traffic[0].all_to_all == count * 4 * static_cast<std::size_t>(n - 1));
  }
}

TEST_CASE("send and recv: a ring of N = 2..8 ranks, three messages each, matched in issue order") {
  for (int n = 2; n <= 8; ++n) {
    CAPTURE(n);
    const std::size_t count = 7;
    std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
    std::vector<fsdp::traffic_counters> traffic(static_cast<std::size_t>(n));
    fsdp::threads::world{n}.run([&](comm_t& comm) {
      const int r = comm.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
      // Sends on one queue, receives on another: a rank's sends and receives run concurrently,
      // as a pipeline stage's do.
      fsdp::host_queue out("send"), in("recv");
      std::vector<std::vector<float>> msgs(3, std::vector<float>(count)), into(3, std::vector<float>(count, -1.0f));
      std::vector<fsdp::host_event> done;
      for (std::size_t m = 0; m < 3; ++m) {
        for (std::size_t k = 0; k < count; ++k) msgs[m][k] = value(r, static_cast<int>(m), k);
        done.push_back(comm.send(msgs[m].data(), count, dtype::f32, next, out));
      }
      for (std::size_t m = 0; m < 3; ++m) done.push_back(comm.recv(into[m].data(), count, dtype::f32, prev, in));
      for (auto& e : done) e.wait(comm.timeout());
      for (const auto& v : into) got[static_cast<std::size_t>(r)].insert(got[static_cast<std::size_t>(r)].end(), v.begin(), v.end());
      traffic[static_cast<std::size_t>(r)] = comm.traffic();
    });
    for (int r = 0; r < n; ++r) {
      const int prev = (r + n - 1) % n;
      for (std::size_t m = 0; m < 3; ++m)
        for (std::size_t k = 0; k < count; ++k) REQUIRE(got[static_cast<std::size_t>(r)][m * count + k] == value(prev, static_cast<int>(m), k));
      CHECK(traffic[static_cast<std::size_t>(r)].send == 3 * count * sizeof(float));  // a recv sends nothing
      CHECK(traffic[static_cast<std::size_t>(r)].collectives == 6);
      CHECK(traffic[static_cast<std::size_t>(r)].total() == 3 * count * sizeof(float));
    }
  }
}

TEST_CASE("send and recv between two ranks of a split, and across simulated hosts: inter_host is the message") {
  std::vector<fsdp::traffic_counters> traffic(4);
  std::vector<float> got(4, 0.0f);
  fsdp::threads::world{4, {.ranks_per_host = 2}}.run([&](comm_t& world) {
    // Pairs {0, 2} and {1, 3}: each pair spans the two hosts.
    comm_t pair = world.split(world.rank() % 2, world.rank());
    fsdp::host_queue q;
    float x = static_cast<float>(world.rank()) + 0.5f, y = 0;
    if (pair.rank() == 0) pair.send(&x, 1, dtype::f32, 1, q).wait(pair.timeout());
    else pair.recv(&y, 1, dtype::f32, 0, q).wait(pair.timeout());
    got[static_cast<std::size_t>(world.rank())] = y;
    traffic[static_cast<std::size_t>(world.rank())] = pair.traffic();
  });
  CHECK(got == std::vector<float>{0.0f, 0.0f, 0.5f, 1.5f});
  CHECK(traffic[0].send == 4);
  CHECK(traffic[0].inter_host == 4);
  CHECK(traffic[2].send == 0);
  CHECK(traffic[2].inter_host == 0);
}

TEST_CASE("send and recv of different lengths: errc::mismatch naming both ranks") {
  const auto [e, seconds] = failing_run(2, [](comm_t& comm) {
    fsdp::host_queue q;
    std::vector<float> v(8);
    if (comm.rank() == 0) comm.send(v.data(), 4, dtype::f32, 1, q).wait(comm.timeout());
    else comm.recv(v.data(), 5, dtype::f32, 0, q).wait(comm.timeout());
  });
  CHECK(e.code() == fsdp::errc::mismatch);
  CHECK(contains(e.what(), "rank 0 sent 4 f32 but rank 1 receives 5 f32"));
  CHECK(seconds < 5.0);
}

TEST_CASE("a recv whose sender never sends ends in errc::timeout naming the peer; one whose sender returned, in peer_failure") {
  SUBCASE("the sender is stuck") {
    const auto [e, seconds] = failing_run(2, [](comm_t& comm) {
      fsdp::host_queue q;
      float x = 0;
      if (comm.rank() == 1) comm.recv(&x, 1, dtype::f32, 0, q).wait(comm.timeout() * 4);
      else std::this_thread::sleep_for(1500ms);
    });
    CHECK(e.code() == fsdp::errc::timeout);
    CHECK(contains(e.what(), "recv of 1 f32 from rank 0 (message #0)"));
    CHECK(contains(e.what(), "waiting for rank 0"));
    CHECK(seconds < 5.0);
  }
  SUBCASE("the sender returned") {
    const auto [e, seconds] = failing_run(2, [](comm_t& comm) {
      fsdp::host_queue q;
      float x = 0;
      if (comm.rank() == 1) comm.recv(&x, 1, dtype::f32, 0, q).wait(comm.timeout() * 4);
    });
    CHECK(e.code() == fsdp::errc::peer_failure);
    CHECK(contains(e.what(), "rank 0 returned without joining it"));
    CHECK(seconds < 5.0);
  }
}

TEST_CASE("send and recv to no other rank, and all_to_all over overlapping buffers: invalid_argument, nothing counted") {
  fsdp::threads::world{2}.run([](comm_t& comm) {
    fsdp::host_queue q;
    std::vector<float> v(8);
    for (int peer : {comm.rank(), -1, 2}) {
      CAPTURE(peer);
      const fsdp::error e = fsdp_test::catch_error([&] { comm.send(v.data(), 1, dtype::f32, peer, q); });
      CHECK(e.code() == fsdp::errc::invalid_argument);
      CHECK(contains(e.what(), "the peer must be another rank of this group of 2"));
      CHECK(fsdp_test::catch_error([&] { comm.recv(v.data(), 1, dtype::f32, peer, q); }).code() == fsdp::errc::invalid_argument);
    }
    const fsdp::error overlap = fsdp_test::catch_error([&] { comm.all_to_all(v.data(), v.data() + 2, 2, dtype::f32, q); });
    CHECK(overlap.code() == fsdp::errc::invalid_argument);
    CHECK(contains(overlap.what(), "all_to_all of 2 f32: the send and receive buffers overlap"));
    CHECK(comm.traffic() == fsdp::traffic_counters{});
  });
}
