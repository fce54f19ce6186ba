// shard_group replaying a schedule::plan given as options.plan: the plan's buckets,
// the position at which each all-gather is issued, and how long each reduction may stay in
// flight. Parity with the reference, the issue points seen in memory, the memory bound, the
// step trace, and plans that cannot be replayed. Only parity needs peers' values: the other
// cases run each rank alone on a fake_communicator.

#include <doctest/doctest.h>

#include <optional>

#include "common/catch_error.hpp"
#include "common/fake_communicator.hpp"
#include "common/mlp.hpp"
#include "fsdp/schedule/auto_bucket.hpp"

using namespace fsdp_test;

namespace {

using planned_group = fsdp::shard_group<fsdp::buffer<float>>;
using fake_planned_group = fsdp::shard_group<fsdp::buffer<float>, fake_communicator>;

// The parity model's 4 units as 3 buckets {0}, {1, 2}, {3}; buckets run in forward positions
// 0, 1, 2 and backward positions 2, 1, 0 (bucket 2 first).
fsdp::schedule::plan three_buckets(std::vector<int> forward_issue, std::vector<int> backward_issue, std::vector<int> reduce_wait) {
  return {"test", {0, 1, 1, 2}, std::move(forward_issue), std::move(backward_issue), std::move(reduce_wait)};
}

}  // namespace

TEST_CASE("plan replay: parity with the reference for on-demand, prefetch-all and all-reductions-in-flight plans") {
  train_config cfg;
  cfg.opt = optimizer::adamw;
  cfg.steps = 6;
  const auto ref = train_reference(cfg);
  // forward_issue / backward_issue per bucket (by bucket index), reduce_wait per bucket.
  const std::vector<fsdp::schedule::plan> plans = {
      three_buckets({0, 1, 2}, {2, 1, 0}, {3, 2, 1}),  // on demand; bucket 2 is waited at backward position 1
      three_buckets({0, 0, 0}, {0, 0, 0}, {3, 3, 3}),  // everything gathered at the first position; reductions all in flight
      three_buckets({0, 0, 1}, {1, 0, 0}, {3, 3, 1}),
  };
  for (const auto& p : plans) {
    for (int n : {2, 3, 4}) {
      CAPTURE(n);
      CAPTURE(fsdp::schedule::to_string(p));
      const auto got = train_sharded<planned_group>(n, cfg, {.plan = p});
      CHECK(max_rel_diff(got, ref) <= 1e-5);
    }
  }
}

TEST_CASE("plan replay: all-gathers are issued where the plan says, and memory stays within the planned bound") {
  for (int rank : {0, 1}) {
    fake_communicator comm{rank, 2};
    for (const bool prefetch_all : {false, true}) {
      CAPTURE(prefetch_all);
      model<float> m;
      const auto p = prefetch_all ? three_buckets({0, 0, 0}, {0, 0, 0}, {3, 3, 3}) : three_buckets({0, 1, 2}, {2, 1, 0}, {3, 2, 1});
      fake_planned_group g{comm, {}, {.plan = p}};
      m.register_with(g);
      g.finalize(per_shard_init());
      REQUIRE(g.num_buckets() == 3);
      REQUIRE(g.plan().has_value());
      fsdp::adamw opt{g, {}};
      train_config cfg;
      for (int step = 0; step < 3; ++step) {
        g.device().reset_peak_memory();
        if (step == 2) {
          // After the first step the recorded order drives the plan: right after the first
          // pre_forward, every bucket is gathered (prefetch_all) or only bucket 0.
          g.pre_forward(0);
          const std::size_t bucket0 = g.layout(0).padded_numel() * sizeof(float);
          std::size_t all = 0;
          for (std::size_t b = 0; b < 3; ++b) all += g.layout(b).padded_numel() * sizeof(float);
          CHECK(g.memory().transient_live == (prefetch_all ? all : bucket0));
          g.post_forward(0);
          g.reshard_all();
        }
        sharded_step(g, m, cfg, step);
        opt.step();
        opt.zero_grad();
        const auto bound = g.transient_memory_bound();
        CHECK(g.memory().transient_peak <= std::max(bound.forward, bound.backward));
      }
      const auto bound = g.transient_memory_bound();
      std::size_t all = 0;
      for (std::size_t b = 0; b < 3; ++b) all += g.layout(b).padded_numel() * sizeof(float);
      if (prefetch_all) CHECK(bound.forward == all);  // every bucket gathered at position 0
    }
  }
}

TEST_CASE("plan replay: step_trace describes the step the planner needs") {
  for (int rank : {0, 1}) {
    fake_communicator comm{rank, 2};
    model<float> m;
    fake_planned_group g{comm, {}, {.plan = three_buckets({0, 0, 1}, {1, 0, 0}, {3, 3, 3})}};
    m.register_with(g);
    g.finalize(per_shard_init());
    CHECK_THROWS_AS(g.step_trace(), fsdp::error);  // no step yet
    fsdp::sgd opt{g, {}};
    train_config cfg;
    for (int step = 0; step < 2; ++step) {
      sharded_step(g, m, cfg, step);
      opt.step();
      opt.zero_grad();
    }
    const auto t = g.step_trace();
    CHECK(t.units.size() == 4);
    CHECK(t.world_size == 2);
    CHECK(t.shard_size == 2);
    CHECK(t.forward_order == std::vector<int>{0, 1, 2, 3});
    CHECK(t.backward_order == std::vector<int>{3, 2, 1, 0});
    CHECK(t.units[2].param_numels == std::vector<std::size_t>{341, 31});
    CHECK(t.units[1].param_numels.size() == 3);  // the 1-element gain too
    for (const auto& u : t.units) CHECK(u.forward_s > 0);
    CHECK(t.optimizer_s > 0);  // the optimizer ran between the two steps
    CHECK_NOTHROW(fsdp::schedule::validate(t, *g.plan()));
  }
}

TEST_CASE("plan replay: plans that do not fit the group are refused with a reason") {
  for (int rank : {0, 1}) {
    fake_communicator comm{rank, 2};
    {
      model<float> m;
      auto p = three_buckets({0, 1, 2}, {2, 1, 0}, {3, 2, 1});
      p.forward_issue.pop_back();
      fake_planned_group g{comm, {}, {.plan = p}};
      m.register_with(g);
      const auto e = catch_error([&] { g.finalize(per_shard_init()); });
      CHECK(e.code() == fsdp::errc::invalid_argument);
      CHECK(std::string(e.what()).find("one forward_issue, backward_issue and reduce_wait per bucket") != std::string::npos);
    }
    {
      // Bucket 1 is issued at forward position 2, after its own position 1: known to be wrong
      // once the first step has recorded the order.
      model<float> m;
      fake_planned_group g{comm, {}, {.plan = three_buckets({0, 2, 2}, {2, 1, 0}, {3, 2, 1})}};
      m.register_with(g);
      g.finalize(per_shard_init());
      fsdp::sgd opt{g, {}};
      train_config cfg;
      sharded_step(g, m, cfg, 0);
      const auto e = catch_error([&] { opt.step(); });
      CHECK(std::string(e.what()).find("issued at position 2, after its own position 1") != std::string::npos);
    }
  }
}

TEST_CASE("one schedule path: prefetch depths are replayed as the plan schedule::prefetch_plan makes") {
  for (int rank : {0, 1}) {
    fake_communicator comm{rank, 2};
    for (const auto& [forward, backward] : {std::pair{1, 1}, std::pair{0, 2}, std::pair{3, 0}}) {
      CAPTURE(forward);
      CAPTURE(backward);
      model<float> m;
      fsdp::shard_group<fsdp::buffer<float>, fsdp::fixed_bytes, fake_communicator> g{comm, {}, {.prefetch = {.forward = forward, .backward = backward}, .bucket = {.bytes = 600}}};
      m.register_with(g);
      g.finalize(per_shard_init());
      CHECK_FALSE(g.plan().has_value());  // the order is not known before the first step
      fsdp::sgd opt{g, {}};
      train_config cfg;
      sharded_step(g, m, cfg, 0);
      opt.step();
      REQUIRE(g.plan().has_value());
      // The same plan as from_policies() makes from the step's trace, field by field.
      const auto expect = fsdp::schedule::from_policies(g.step_trace(), fsdp::fixed_bytes{.bytes = 600}, fsdp::prefetch{.forward = forward, .backward = backward});
      CHECK(g.plan()->bucket_of_unit == expect.bucket_of_unit);
      CHECK(g.plan()->forward_issue == expect.forward_issue);
      CHECK(g.plan()->backward_issue == expect.backward_issue);
      CHECK(g.plan()->reduce_wait == expect.reduce_wait);
    }
  }
}
