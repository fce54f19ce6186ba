// choose_sharding: the cost of shard groups that follow the hosts, worked out by hand; the
// choice on a slow and on a fast network, under a memory limit; and measure_links on a world of
// simulated hosts.
#include <doctest/doctest.h>

#include <string>

#include "common.hpp"
#include "common/catch_error.hpp"
#include "fsdp/comm/threads.hpp"
#include "fsdp/schedule/choose_sharding.hpp"

namespace {

using fsdp::schedule::cost_model;
using fsdp::schedule::host_links;
using fsdp::schedule::link_cost;

cost_model uniform(double alpha, double beta) { return {{alpha, beta}, {alpha, beta}, {alpha, beta}}; }

// 2 hosts of 2 ranks: 1 GB/s inside a host, `network` bytes/s across (one rank alone).
host_links two_by_two(double network) { return {.hosts = 2, .ranks_per_host = 2, .intra = uniform(1e-5, 1e9), .inter = uniform(1e-4, network)}; }

}  // namespace

TEST_CASE("cost_for: a group inside a host pays the host's link, one across hosts a share of the network") {
  const host_links l = two_by_two(1e8);
  // Per host: hybrid's shard groups are inside hosts; its replicas (one rank per host) cross,
  // both ranks of a host at once, so each gets half the network.
  const cost_model hybrid = fsdp::schedule::cost_for(l, 4, 2);
  CHECK(hybrid.all_gather == link_cost{1e-5, 1e9});
  CHECK(hybrid.all_reduce.beta_bytes_per_s == doctest::Approx(0.5e8));
  CHECK(hybrid.all_reduce.alpha_s == doctest::Approx(1e-4));
  // Full: 2 of each rank's 3 peers are on the other host: 2/3 of the bytes at 0.5e8 per rank
  // (against 1/3 at 1e9 in parallel): 1 / (2/3 / 0.5e8).
  const cost_model full = fsdp::schedule::cost_for(l, 4, 4);
  CHECK(full.all_gather.beta_bytes_per_s == doctest::Approx(0.75e8));
  CHECK(full.reduce_scatter.beta_bytes_per_s == doctest::Approx(0.75e8));
  // None: the all-reduce over all 4 ranks, 2/3 across, as full's all-gather.
  CHECK(fsdp::schedule::cost_for(l, 4, 1).all_reduce.beta_bytes_per_s == doctest::Approx(0.75e8));
  // One rank per host: every peer is remote and nothing shares the network.
  const host_links one{.hosts = 4, .ranks_per_host = 1, .intra = std::nullopt, .inter = uniform(0, 1e8)};
  CHECK(fsdp::schedule::cost_for(one, 4, 4).all_gather.beta_bytes_per_s == doctest::Approx(1e8));
}

TEST_CASE("choose_sharding: a slow network picks a shard group per host; a memory limit can overrule") {
  // 5 units of 1M f32 (4 MiB each), 10 ms of compute per unit and pass, 2 hosts x 2 ranks.
  const auto t = sched_test::equal_units(5, 1 << 20, 0.01, 0.01, 4, 4);
  const auto slow = fsdp::schedule::choose_sharding(t, two_by_two(25e6));  // 200 Mbit/s
  CHECK(slow.sharding == fsdp::hybrid_shard_per_host());
  REQUIRE(slow.candidates.size() == 3);  // 4 (full), 2 (per host), 1 (none)
  CHECK(slow.candidates[0].sharding == fsdp::full_shard());
  CHECK(slow.candidates[2].sharding == fsdp::no_shard());
  // Per host sends the least across: only its all-reduce of a half shard crosses.
  CHECK(slow.candidates[1].inter_host_bytes < slow.candidates[0].inter_host_bytes);
  CHECK(slow.candidates[1].inter_host_bytes < slow.candidates[2].inter_host_bytes);
  CHECK(slow.why.find("-> hybrid_shard_per_host()") != std::string::npos);
  // Full sharding needs the least memory: a limit below the others' peaks leaves only it.
  const std::size_t limit = slow.candidates[0].peak_bytes;
  REQUIRE(limit < slow.candidates[1].peak_bytes);
  CHECK(fsdp::schedule::choose_sharding(t, two_by_two(25e6), limit).sharding == fsdp::full_shard());
  const std::string what = fsdp_test::catch_error([&] { fsdp::schedule::choose_sharding(t, two_by_two(25e6), limit - 1); }).what();
  CHECK(what.find("no shard size fits the memory limit") != std::string::npos);
}

TEST_CASE("choose_sharding: when the network is free every choice is as fast, and the one sending least across wins") {
  const auto t = sched_test::equal_units(5, 1 << 20, 0.01, 0.01, 4, 4);
  const auto c = fsdp::schedule::choose_sharding(t, two_by_two(1e15));
  for (const auto& x : c.candidates) CHECK(x.step_s == doctest::Approx(c.candidates[0].step_s).epsilon(0.05));
  CHECK(c.sharding == fsdp::hybrid_shard_per_host());
}

TEST_CASE("measure_links: both levels on a world of 2 simulated hosts, the same on every rank; uneven hosts refused") {
  std::vector<host_links> got(4);
  const fsdp::schedule::calibrate_options quick{.counts = {256, 4096}, .warmup = 0, .reps = 2};
  fsdp::threads::world{4, {.ranks_per_host = 2}}.run([&](fsdp::threads::communicator& comm) {
    fsdp::host_queue q;
    got[static_cast<std::size_t>(comm.rank())] = fsdp::schedule::measure_links(comm, q, quick);
  });
  for (const auto& l : got) {
    CHECK(l.hosts == 2);
    CHECK(l.ranks_per_host == 2);
    REQUIRE(l.intra);
    REQUIRE(l.inter);
    CHECK(*l.intra == *got[0].intra);
    CHECK(*l.inter == *got[0].inter);
    CHECK(l.inter->all_gather.beta_bytes_per_s > 0);
  }
  std::string what;
  try {
    fsdp::threads::world{4, {.ranks_per_host = 3}}.run([&](fsdp::threads::communicator& comm) {
      fsdp::host_queue q;
      fsdp::schedule::measure_links(comm, q, quick);
    });
  } catch (const fsdp::error& e) {
    what = e.what();
  }
  CHECK(what.find("hosts hold different numbers of ranks, or out of order: 2 hosts: [0 0 0 1]") != std::string::npos);
}
