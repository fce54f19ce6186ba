// hpZ (sharding contract 3, `reshard_after_forward_to = k`; FSDP2's reshard_after_forward=k,
// ZeRO++'s secondary partition): after forward each rank keeps 1/k of the gathered parameters,
// and backward gathers inside runs of k ranks. The values gathered are the same, so training is
// bit-identical to full sharding; the counters show the backward gathers inside the k ranks,
// and none of them crosses a host when k is the ranks of a host.
#include <doctest/doctest.h>

#include <numeric>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "common/mlp.hpp"

namespace {

using namespace fsdp_test;
using group = fsdp::shard_group<fsdp::buffer<float>>;

fsdp::sharding hpz(int shard_size, int k) { return {.shard_size = shard_size, .reshard_after_forward = true, .reshard_after_forward_to = k}; }

// Two steps on `n` ranks (`per_host` a host); each rank's traffic over the second.
std::vector<fsdp::traffic_counters> traffic_per_rank(int n, int per_host, fsdp::sharding s, std::vector<std::size_t>* left = nullptr) {
  std::vector<fsdp::traffic_counters> sent(static_cast<std::size_t>(n));
  if (left) left->assign(static_cast<std::size_t>(n), 1);
  fsdp::threads::world{n, {.ranks_per_host = per_host}}.run([&](fsdp::threads::communicator& comm) {
    model<float> m;
    group g{comm, {}, {.sharding = s}};
    m.register_with(g);
    g.finalize(per_shard_init());
    fsdp::sgd opt{g, {}};
    sent[static_cast<std::size_t>(comm.rank())] = fsdp_test::second_step_traffic(g, m, opt);
    if (left) (*left)[static_cast<std::size_t>(comm.rank())] = g.memory().transient_live;
  });
  return sent;
}

}  // namespace

TEST_CASE("hpZ: training is bit-identical to full sharding (full, hybrid, frozen parameters, SGD and AdamW)") {
  struct run {
    int ranks;
    fsdp::sharding with, without;
    bool frozen;
  };
  for (auto opt : {optimizer::sgd, optimizer::adamw}) {
    for (const run& r : {run{4, hpz(0, 2), fsdp::full_shard(), false}, run{8, hpz(4, 2), fsdp::hybrid_shard(4), false},
                         run{8, hpz(0, 4), fsdp::full_shard(), true}}) {
      CAPTURE(r.ranks);
      CAPTURE(to_string(r.with));
      train_config cfg;
      cfg.opt = opt;
      if (r.frozen) cfg.frozen = {{0, 0}, {2, 0}};
      const train_result a = train_sharded<group>(r.ranks, cfg, {.sharding = r.with});
      const train_result b = train_sharded<group>(r.ranks, cfg, {.sharding = r.without});
      CHECK(max_rel_diff(a, b) == 0.0);
      CHECK(max_rel_diff(a, train_reference(cfg)) <= 1e-5);
    }
  }
}

TEST_CASE("hpZ: backward gathers run inside the k ranks: the counters show (k-1)/k, and none crosses a host") {
  const int n = 4, k = 2;
  std::uint64_t forward = 0, backward = 0;
  for (std::size_t p : padded_units(n)) {
    forward += p * 4 * (n - 1) / n;
    backward += p * 4 * (k - 1) / k;
  }
  std::vector<std::size_t> left;
  const auto with = traffic_per_rank(n, k, hpz(0, k), &left);
  const auto without = traffic_per_rank(n, k, fsdp::full_shard());
  const auto once = traffic_per_rank(n, k, fsdp::shard_grad_op());  // one gather per step
  for (std::size_t r = 0; r < with.size(); ++r) {
    CAPTURE(r);
    CHECK(with[r].all_gather == forward + backward);
    CHECK(without[r].all_gather == 2 * forward);
    CHECK(with[r].reduce_scatter == without[r].reduce_scatter);
    // Hosts of k ranks: the secondary groups are the hosts, so hpZ's backward gathers add
    // nothing across hosts: as much crosses them as with one gather per step (shard_grad_op).
    CHECK(with[r].inter_host == once[r].inter_host);
    CHECK(with[r].inter_host < without[r].inter_host);
    CHECK(left[r] == 0);  // every secondary freed by the end of the step
  }
}

TEST_CASE("hpZ: the secondary shards are in the memory bound, and evaluation passes free them") {
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    model<float> m;
    group g{comm, {}, {.sharding = hpz(0, 2)}};
    m.register_with(g);
    g.finalize(per_shard_init());
    fsdp::sgd opt{g, {}};
    sharded_step(g, m, train_config{}, 0);
    opt.step();
    g.device().reset_peak_memory();
    sharded_step(g, m, train_config{}, 1);
    g.finish_backward();
    const auto bound = g.transient_memory_bound();
    CHECK(g.memory().transient_peak <= bound.backward);
    // The bound counts each bucket's secondary (padded / 2 floats) on top of full sharding's.
    std::size_t secondaries = 0;
    for (std::size_t b = 0; b < g.num_buckets(); ++b) secondaries += g.layout(b).padded_numel() / 2 * sizeof(float);
    CHECK(secondaries > 0);
    opt.step();
    for (int u = 0; u < g.num_units(); ++u) auto s = g.forward(u);  // forward only: secondaries made
    CHECK(g.memory().transient_live == secondaries);
    g.reshard_all();
    CHECK(g.memory().transient_live == 0);
  });
}

TEST_CASE("hpZ: a size that is not a proper divisor of the shard group, or without resharding, is refused by name") {
  for (const fsdp::sharding s : {hpz(0, 3), hpz(0, 4), hpz(0, 1), hpz(2, 2),
                                 fsdp::sharding{.shard_size = 0, .reshard_after_forward = false, .reshard_after_forward_to = 2}}) {
    CAPTURE(to_string(s));
    fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
      model<float> m;
      group g{comm, {}, {.sharding = s}};
      m.register_with(g);
      const fsdp::error e = catch_error([&] { g.finalize(per_shard_init()); });
      CHECK(e.code() == fsdp::errc::invalid_argument);
      CHECK(std::string(e.what()).find("reshard_after_forward_to needs reshard_after_forward and a size in (1, ") != std::string::npos);
    });
  }
}
