// Tests of the threads backend's link model (world_options::link, comm/threads/link_model.hpp): the
// model's arithmetic and option checks; lower bounds on how long collectives take that follow
// from alpha + bytes / beta (per collective kind, and when two queues or a split share a rank's
// link); that a disabled model adds no delay; that the issuing thread is free while a collective
// is on the link; and that a link wait ends on an abort and on the timeout.
//
// No test asserts speed: every time check is a lower bound the model implies, or a bound well
// below a modelled delay that a correct implementation never comes near. Ranks only record what
// they saw; every check runs on the test thread after world::run.

#include "fsdp/comm/threads.hpp"

#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/host.hpp"

namespace {

using namespace std::chrono_literals;
using fsdp::dtype;
using fsdp::milliseconds;
using fsdp::threads::link_model;
using comm_t = fsdp::threads::communicator;
using clock_type = std::chrono::steady_clock;

// Timeout for runs that must succeed: long, so a slow sanitizer build never trips it.
constexpr milliseconds generous = 20000ms;
// The modelled seconds are cast to clock ticks by truncation, which can lose under a nanosecond.
constexpr double slack_s = 1e-6;
// A latency so large against the bytes moved that the bytes' share is negligible.
constexpr double huge_beta = 1e15;

double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

fsdp::threads::world make_world(int n, link_model link, milliseconds timeout = generous) {
  return fsdp::threads::world{n, {.timeout = timeout, .link = link}};
}

TEST_CASE("link_model: seconds is alpha plus bytes over beta and off by default") {
  const link_model off{};
  CHECK_FALSE(off.enabled());
  CHECK(off.seconds(1'000'000) == 0.0);
  CHECK(fsdp::threads::world_options{}.link == off);

  const link_model l{.alpha_s = 0.5, .beta_bytes_per_s = 1000};
  CHECK(l.enabled());
  CHECK(l.seconds(0) == doctest::Approx(0.5));
  CHECK(l.seconds(2000) == doctest::Approx(2.5));
  CHECK(l == link_model{0.5, 1000});
  CHECK_FALSE(l == off);
  CHECK(to_string(l) == "link_model{.alpha_s = 0.5, .beta_bytes_per_s = 1000}");

  // beta = 0 is "no model" even with a latency set: alpha alone never applies.
  const link_model alpha_only{.alpha_s = 0.2};
  CHECK_FALSE(alpha_only.enabled());
  CHECK(alpha_only.seconds(0) == 0.0);

  // What each rank's communicator reports is what the world was given.
  std::vector<link_model> seen(2);
  make_world(2, l).run([&](comm_t& comm) { seen[static_cast<std::size_t>(comm.rank())] = comm.link(); });
  CHECK(seen[0] == l);
  CHECK(seen[1] == l);
}

TEST_CASE("link_model: bad options throw invalid_argument naming the field") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::array<link_model, 3> bad_alpha{{{-1, 1e9}, {nan, 1e9}, {inf, 1e9}}};
  for (const link_model& l : bad_alpha) {
    const fsdp::error e = fsdp_test::catch_error([&] { make_world(2, l); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("link.alpha_s") != std::string::npos);
  }
  const std::array<link_model, 4> bad_beta{{{0, -1}, {0, nan}, {0, inf}, {0, -inf}}};
  for (const link_model& l : bad_beta) {
    const fsdp::error e = fsdp_test::catch_error([&] { make_world(2, l); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("link.beta_bytes_per_s") != std::string::npos);
  }
  // The boundaries are accepted: no latency, and beta 0 (off).
  make_world(2, {0, 1e9});
  make_world(2, {0.1, 0});
}

// The example in the threads.hpp file comment and docs/guide.md.
TEST_CASE("link_model: an all_gather takes at least alpha plus the bytes sent over beta") {
  const link_model link{.alpha_s = 0.01, .beta_bytes_per_s = 1e3};
  std::vector<double> elapsed(4);
  std::vector<fsdp::traffic_counters> traffic(4);
  std::vector<std::vector<float>> gathered(4);
  make_world(4, link).run([&](comm_t& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    fsdp::host_queue q;
    std::vector<float> x(4, static_cast<float>(comm.rank())), all(16);
    const auto t0 = clock_type::now();
    comm.all_gather(x.data(), all.data(), 4, dtype::f32, q).wait(comm.timeout());
    elapsed[r] = since(t0);
    traffic[r] = comm.traffic();
    gathered[r] = all;
  });
  // Each rank sends its 4 f32 to each of 3 peers: 48 bytes, 0.01 + 48 / 1e3 = 0.058 s.
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(traffic[r].all_gather == 48);
    CHECK(elapsed[r] >= link.seconds(48) - slack_s);
    CHECK(link.seconds(48) == doctest::Approx(0.058));
    for (std::size_t k = 0; k < 16; ++k) CHECK(gathered[r][k] == static_cast<float>(k / 4));
  }
}

TEST_CASE("link_model: each collective kind is charged the bytes its rank sends") {
  // 4 ranks of f32. The counts give every kind 15000 sent bytes, 0.15 s at 1e5 B/s:
  // all_gather and reduce_scatter send count*4*3, all_reduce 2*count*4*3/4, broadcast count*4*3/4.
  constexpr int n = 4;
  const link_model link{.alpha_s = 0.05, .beta_bytes_per_s = 1e5};
  constexpr std::uint64_t sent = 15000;
  constexpr std::size_t c_gather = 1250, c_scatter = 1250, c_reduce = 2500, c_bcast = 5000;
  enum kind_index { gather, scatter, reduce, bcast, barrier, split, kinds };
  std::vector<std::array<double, kinds>> elapsed(n);
  std::vector<std::array<std::uint64_t, 4>> bytes(n);
  make_world(n, link).run([&](comm_t& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    fsdp::host_queue q;
    std::vector<float> in(n * c_bcast, 1.0f), out(n * c_bcast);
    auto timed = [&](kind_index k, auto&& issue) {
      const auto t0 = clock_type::now();
      issue();
      elapsed[r][k] = since(t0);
    };
    timed(gather, [&] { comm.all_gather(in.data(), out.data(), c_gather, dtype::f32, q).wait(comm.timeout()); });
    timed(scatter, [&] {
      comm.reduce_scatter(in.data(), out.data(), c_scatter, dtype::f32, fsdp::reduce_op::sum, q).wait(comm.timeout());
    });
    timed(reduce, [&] {
      comm.all_reduce(in.data(), out.data(), c_reduce, dtype::f32, fsdp::reduce_op::sum, q).wait(comm.timeout());
    });
    timed(bcast, [&] { comm.broadcast(in.data(), c_bcast, dtype::f32, 0, q).wait(comm.timeout()); });
    timed(barrier, [&] { comm.barrier(); });
    timed(split, [&] { (void)comm.split(0, comm.rank()); });
    const fsdp::traffic_counters t = comm.traffic();
    bytes[r] = {t.all_gather, t.reduce_scatter, t.all_reduce, t.broadcast};
  });
  for (std::size_t r = 0; r < n; ++r) {
    CAPTURE(r);
    for (std::size_t k = 0; k < 4; ++k) CHECK(bytes[r][k] == sent);  // the counters agree with the model
    CHECK(elapsed[r][gather] >= link.seconds(sent) - slack_s);
    CHECK(elapsed[r][scatter] >= link.seconds(sent) - slack_s);
    CHECK(elapsed[r][reduce] >= link.seconds(sent) - slack_s);
    CHECK(elapsed[r][bcast] >= link.seconds(sent) - slack_s);
    CHECK(elapsed[r][barrier] >= link.alpha_s - slack_s);  // no data, still a latency
    CHECK(elapsed[r][split] >= link.alpha_s - slack_s);
  }
}

TEST_CASE("link_model: collectives on two queues of one rank serialize on its link") {
  // As shard_group issues them: an all_gather on one queue, a reduce_scatter on another.
  const link_model link{.alpha_s = 0.25, .beta_bytes_per_s = huge_beta};
  std::vector<double> elapsed(2);
  make_world(2, link).run([&](comm_t& comm) {
    fsdp::host_queue gather_q("all_gather"), scatter_q("reduce_scatter");
    std::vector<float> shard(8, 1.0f), full(16), grad(16, 1.0f), grad_shard(8);
    const auto t0 = clock_type::now();
    auto gathered = comm.all_gather(shard.data(), full.data(), 8, dtype::f32, gather_q);
    auto reduced = comm.reduce_scatter(grad.data(), grad_shard.data(), 8, dtype::f32, fsdp::reduce_op::avg, scatter_q);
    gathered.wait(comm.timeout());
    reduced.wait(comm.timeout());
    elapsed[static_cast<std::size_t>(comm.rank())] = since(t0);
  });
  // Each alone takes 0.25 s; on separate links they would finish together after about 0.25 s.
  CHECK(elapsed[0] >= 2 * 0.25 - slack_s);
  CHECK(elapsed[1] >= 2 * 0.25 - slack_s);
}

TEST_CASE("link_model: the world and its split share each rank's link") {
  // As hybrid sharding uses them: one collective on the world, one on a split, two queues.
  const link_model link{.alpha_s = 0.25, .beta_bytes_per_s = huge_beta};
  std::vector<double> elapsed(2);
  make_world(2, link).run([&](comm_t& comm) {
    comm_t replicas = comm.split(0, comm.rank());
    fsdp::host_queue world_q("world"), split_q("split");
    std::vector<float> a(8, 1.0f), b(8, 1.0f);
    const auto t0 = clock_type::now();
    auto on_world = comm.all_reduce(a.data(), a.data(), 8, dtype::f32, fsdp::reduce_op::sum, world_q);
    auto on_split = replicas.all_reduce(b.data(), b.data(), 8, dtype::f32, fsdp::reduce_op::sum, split_q);
    on_world.wait(comm.timeout());
    on_split.wait(comm.timeout());
    elapsed[static_cast<std::size_t>(comm.rank())] = since(t0);
  });
  CHECK(elapsed[0] >= 2 * 0.25 - slack_s);
  CHECK(elapsed[1] >= 2 * 0.25 - slack_s);
}

TEST_CASE("link_model: a disabled model adds no modelled delay") {
  // alpha = 0.2 s with beta = 0: off. Three collectives must take well under one alpha; with the
  // model on they would take at least 0.6 s.
  const link_model off{.alpha_s = 0.2, .beta_bytes_per_s = 0};
  std::vector<double> elapsed(2);
  make_world(2, off).run([&](comm_t& comm) {
    fsdp::host_queue q;
    std::vector<float> x(4, 1.0f), all(8);
    const auto t0 = clock_type::now();
    comm.all_gather(x.data(), all.data(), 4, dtype::f32, q).wait(comm.timeout());
    comm.all_reduce(x.data(), x.data(), 4, dtype::f32, fsdp::reduce_op::sum, q).wait(comm.timeout());
    comm.barrier();
    elapsed[static_cast<std::size_t>(comm.rank())] = since(t0);
  });
  CHECK(elapsed[0] < off.alpha_s);
  CHECK(elapsed[1] < off.alpha_s);
}

TEST_CASE("link_model: the issuing thread works while a collective is on the link") {
  const link_model link{.alpha_s = 0.3, .beta_bytes_per_s = huge_beta};
  struct seen_t {
    bool ready_after_work = true;
    bool ready_after_wait = false;
    double work_sum = 0;
    double work_done = 0;  // seconds from issue to the end of the work
    double elapsed = 0;
    double cpu_while_waiting = 0;
  };
  std::vector<seen_t> seen(2);
  make_world(2, link).run([&](comm_t& comm) {
    seen_t& me = seen[static_cast<std::size_t>(comm.rank())];
    fsdp::host_queue q;
    std::vector<float> x(4, 1.0f), all(8);
    const auto t0 = clock_type::now();
    auto done = comm.all_gather(x.data(), all.data(), 4, dtype::f32, q);
    // Compute on the issuing thread while the collective is in flight.
    std::vector<double> work(100000);
    for (std::size_t i = 0; i < work.size(); ++i) work[i] = static_cast<double>(i % 10);
    for (double w : work) me.work_sum += w;
    me.work_done = since(t0);
    me.ready_after_work = done.ready();
    const std::clock_t cpu0 = std::clock();
    done.wait(comm.timeout());
    me.cpu_while_waiting = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
    me.elapsed = since(t0);
    me.ready_after_wait = done.ready();
  });
  for (const seen_t& me : seen) {
    CHECK(me.work_sum == 450000.0);
    // Issue and work ended inside the modelled 0.3 s: the link's time is not the caller's.
    CHECK(me.work_done < link.alpha_s);
    CHECK_FALSE(me.ready_after_work);
    CHECK(me.ready_after_wait);
    CHECK(me.elapsed >= link.alpha_s - slack_s);
    // The link sleeps rather than spins: both ranks' queue threads spinning through 0.3 s would
    // burn far more process CPU time than this.
    CHECK(me.cpu_while_waiting < link.alpha_s / 3);
  }
}

TEST_CASE("link_model: an abort ends a link wait at once") {
  // Both ranks' queue threads sleep on a 1.5 s link; rank 1 aborts the world after 0.2 s.
  const link_model link{.alpha_s = 1.5, .beta_bytes_per_s = huge_beta};
  std::vector<double> elapsed(2);
  std::vector<fsdp::errc> code(2, fsdp::errc::internal);
  const fsdp::error e = fsdp_test::catch_error([&] {
    make_world(2, link).run([&](comm_t& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      fsdp::host_queue q;
      std::vector<float> x(4, 1.0f), all(8);
      const auto t0 = clock_type::now();
      auto done = comm.all_gather(x.data(), all.data(), 4, dtype::f32, q);
      if (r == 1) {
        std::this_thread::sleep_for(200ms);
        comm.abort("rank 1 gives up");
      }
      try {
        done.wait(comm.timeout());
      } catch (const fsdp::error& err) {
        elapsed[r] = since(t0);
        code[r] = err.code();
        throw;
      }
    });
  });
  CHECK(e.code() == fsdp::errc::peer_failure);
  CHECK(std::string(e.what()).find("rank 1 gives up") != std::string::npos);
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(code[r] == fsdp::errc::peer_failure);
    CHECK(elapsed[r] < 1.0);  // far sooner than the 1.5 s the link would have taken
  }
}

TEST_CASE("link_model: a link time past the timeout fails with a timeout") {
  // A 5 s link under a 0.3 s timeout: the wait stays bounded by the timeout.
  const link_model link{.alpha_s = 5, .beta_bytes_per_s = huge_beta};
  double elapsed = 0;
  const auto t0 = clock_type::now();
  const fsdp::error e = fsdp_test::catch_error([&] {
    make_world(2, link, 300ms).run([&](comm_t& comm) {
      fsdp::host_queue q;
      std::vector<float> x(4, 1.0f), all(8);
      comm.all_gather(x.data(), all.data(), 4, dtype::f32, q).wait(generous);
    });
  });
  elapsed = since(t0);
  CHECK(e.code() == fsdp::errc::timeout);
  CHECK(std::string(e.what()).find("link model") != std::string::npos);
  CHECK(elapsed >= 0.3 - slack_s);
  CHECK(elapsed < 2.5);  // bounded by the timeout, not by the 5 s link
}

}  // namespace
