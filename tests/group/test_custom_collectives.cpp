// Custom collectives (policy/collectives.hpp): a shard_group whose all-gather and reduce-scatter
// are replaced by an engine's own trains like the plain reference, the replacements are what
// runs (the counters show their traffic, not the built-in collectives'), and a replacement that
// breaks its contract is caught by the same comparison.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "common/mlp.hpp"

namespace {

using namespace fsdp_test;
using group = fsdp::shard_group<fsdp::buffer<float>>;
using comm_t = fsdp::threads::communicator;

// Both collectives through all-reduces, a different algorithm with the same results: the
// gather zeroes every chunk but this rank's and sums; the reduce-scatter averages the whole
// buffer and keeps this rank's chunk. `gather_sums` = false breaks contract 1 (the peers'
// chunks stay zero).
group::collectives_type via_all_reduce(std::atomic<int>* calls, bool gather_sums = true) {
  group::collectives_type c;
  c.all_gather = [=](float* full, std::size_t n, comm_t& g, fsdp::host_queue& q) {
    ++*calls;
    const auto me = static_cast<std::size_t>(g.rank()), size = static_cast<std::size_t>(g.size());
    q.launch([=](auto) {
      for (std::size_t r = 0; r < size; ++r)
        if (r != me) std::fill_n(full + r * n, n, 0.0f);
    });
    if (gather_sums) g.all_reduce(full, full, n * size, fsdp::dtype::f32, fsdp::reduce_op::sum, q);
  };
  c.reduce_scatter = [=](const float* full, float* shard, std::size_t n, comm_t& g, fsdp::host_queue& q) {
    ++*calls;
    const auto me = static_cast<std::size_t>(g.rank());
    auto mean = std::make_shared<std::vector<float>>(n * static_cast<std::size_t>(g.size()));
    g.all_reduce(full, mean->data(), mean->size(), fsdp::dtype::f32, fsdp::reduce_op::avg, q);
    q.launch([=](auto) { std::copy_n(mean->data() + me * n, n, shard); });  // `mean` lives until here
  };
  return c;
}

const train_result& reference() {
  static const train_result r = train_reference(train_config{});
  return r;
}

}  // namespace

TEST_CASE("custom collectives: an all-gather and reduce-scatter of the engine's own match the reference") {
  for (auto [n, s] : {std::pair{2, 2}, std::pair{4, 4}, std::pair{4, 2}}) {
    CAPTURE(n);
    CAPTURE(s);
    std::atomic<int> calls{0};
    group::options o{.sharding = s == n ? fsdp::full_shard() : fsdp::hybrid_shard(s)};
    o.collectives = via_all_reduce(&calls);
    CHECK(max_rel_diff(train_sharded<group>(n, train_config{}, o), reference()) <= 1e-5);
    // Per rank and step: 2 gathers and 1 reduction for each of the 4 units.
    CHECK(calls.load() == n * train_config{}.steps * 4 * 3);
  }
}

TEST_CASE("custom collectives: the counters show the replacements' traffic, not the built-in collectives'") {
  std::atomic<int> calls{0};
  std::vector<fsdp::traffic_counters> sent(2);
  fsdp::threads::world{2}.run([&](comm_t& comm) {
    model<float> m;
    group::options o;
    o.collectives = via_all_reduce(&calls);
    group g{comm, {}, o};
    m.register_with(g);
    g.finalize(per_shard_init());
    fsdp::sgd opt{g, {}};
    sharded_step(g, m, train_config{}, 0);  // the first step also checks the unit order
    opt.step();
    const fsdp::traffic_counters start = g.traffic();
    sharded_step(g, m, train_config{}, 1);
    opt.step();
    sent[static_cast<std::size_t>(comm.rank())] = g.traffic() - start;
  });
  for (const auto& t : sent) {
    CHECK(t.all_gather == 0);
    CHECK(t.reduce_scatter == 0);
    CHECK(t.all_reduce > 0);
    CHECK(t.collectives == 4 * 3);  // one all-reduce per gather and per reduction
  }
}

TEST_CASE("custom collectives: a gather that leaves the peers' chunks out is caught by the parity comparison") {
  std::atomic<int> calls{0};
  group::options o;
  o.collectives = via_all_reduce(&calls, /*gather_sums=*/false);
  CHECK(max_rel_diff(train_sharded<group>(2, train_config{}, o), reference()) > 1e-2);
}
