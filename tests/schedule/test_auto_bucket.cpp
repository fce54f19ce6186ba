// auto_bucket makes a plan from a trace and a cost model (the greedy or the searched one, under
// a memory limit); shard_group replays it, or a plan written by hand, given as options.plan, and
// refuses a plan made for other units.

#include "fsdp/schedule/auto_bucket.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "common/mlp.hpp"
#include "fsdp/fsdp.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "schedule/common.hpp"

namespace {

using namespace fsdp::schedule;
using fsdp_test::catch_error;
using sched_test::equal_units;

// 8 units of 4096 f32 on 8 ranks; every collective 10 s of latency (greedy: one bucket).
step_trace eight_units() { return equal_units(8, 4096, 1.0, 2.0, 8, 8); }
cost_model latency_bound() {
  const link_cost l{10.0, 1e30};
  return {l, l, l};
}

// The trace of the parity model (tests/common/mlp.hpp) on `n` ranks, sequential.
step_trace mlp_trace(int n) {
  step_trace t;
  for (const auto& l : fsdp_test::shapes()) t.units.push_back({"", fsdp_test::param_sizes(l), 1e-3, 2e-3});
  use_registration_order(t);
  t.world_size = t.shard_size = n;
  return t;
}
std::vector<std::size_t> mlp_unit_bytes() {
  std::vector<std::size_t> out;
  for (const auto& l : fsdp_test::shapes()) {
    std::size_t n = 0;
    for (std::size_t x : fsdp_test::param_sizes(l)) n += x;
    out.push_back(n * sizeof(float));
  }
  return out;
}

}  // namespace

TEST_CASE("auto_bucket: plan_for is the greedy plan under the limit (best_plan with .search), with the trace's unit bytes") {
  const step_trace t = eight_units();
  const cost_model c = latency_bound();
  const std::size_t limit = std::size_t{1} << 30;
  const fsdp::auto_bucket a{.memory_limit = limit};

  const plan p = a.plan_for(t, c);
  plan greedy = greedy_plan(t, c, limit);
  greedy.name = "auto_bucket{.memory_limit = 1073741824}";
  greedy.unit_bytes.assign(8, 4096 * 4);
  CHECK(p == greedy);
  CHECK(p.num_buckets() == 1);
  CHECK(simulate(t, c, p).peak_bytes <= limit);

  // .search: best_plan's search.
  fsdp::auto_bucket s = a;
  s.search = true;
  plan best = best_plan(t, c, limit);
  best.name = "auto_bucket{.memory_limit = 1073741824, .search = true}";
  best.unit_bytes.assign(8, 4096 * 4);
  CHECK(s.plan_for(t, c) == best);
  CHECK(fsdp::auto_bucket{}.plan_for(t, c).num_buckets() == 1);  // no limit
  // A limit below one bucket's memory has no plan.
  CHECK_THROWS_AS(fsdp::auto_bucket{.memory_limit = 16}.plan_for(t, c), fsdp::error);
}

TEST_CASE("auto_bucket: a trace is validated once, at the door, on its whole walk through plan_for") {
  // Before the check at the door: 16 validations for the greedy walk here and 662 with the
  // search (best_plan, greedy_plan, from_policies, per_unit_prefetch and every candidate's
  // simulator each checked the trace again).
  const step_trace t = equal_units(6, 4096, 1.0, 2.0, 4, 4);
  for (const bool search : {false, true}) {
    CAPTURE(search);
    fsdp::schedule::detail::trace_validations = 0;
    (void)fsdp::auto_bucket{.search = search}.plan_for(t, h100_nvlink(4));
    CHECK(fsdp::schedule::detail::trace_validations == 1);
  }
  fsdp::schedule::detail::trace_validations = 0;
  (void)simulate(t, h100_nvlink(4), per_unit_prefetch(t));  // a plain trace: checked at each door it enters
  CHECK(fsdp::schedule::detail::trace_validations == 2);
}

TEST_CASE("auto_bucket: equality compares its values, and to_string says what is set") {
  const fsdp::auto_bucket a{.memory_limit = std::size_t{1} << 30};
  CHECK(to_string(a) == "auto_bucket{.memory_limit = 1073741824}");
  CHECK(to_string(fsdp::auto_bucket{.memory_limit = 5, .search = true}) == "auto_bucket{.memory_limit = 5, .search = true}");
  CHECK(a == fsdp::auto_bucket{.memory_limit = std::size_t{1} << 30});
  CHECK_FALSE(a == fsdp::auto_bucket{});
  CHECK_FALSE(a == fsdp::auto_bucket{.memory_limit = std::size_t{1} << 30, .search = true});
  // A plan names the unit bytes it was made for only when it knows them.
  const plan p = a.plan_for(equal_units(2, 64, 1, 1, 2, 2), latency_bound());
  CHECK(to_string(p).find(", .unit_bytes = [256, 256]}") != std::string::npos);
  CHECK(to_string(per_unit_prefetch(equal_units(2, 64, 1, 1, 2, 2))).find("unit_bytes") == std::string::npos);
}

TEST_CASE("shard_group refuses a plan made for other units, naming what differs") {
  const plan p = fsdp::auto_bucket{}.plan_for(eight_units(), latency_bound());
  // Runs finalize on one rank for units of these sizes (f32) and returns the error.
  auto refused = [&](std::vector<std::size_t> sizes) {
    std::optional<fsdp::error> caught;
    try {
      fsdp::threads::world{1}.run([&](fsdp::threads::communicator& comm) {
        std::vector<std::unique_ptr<fsdp::buffer<float>>> ps;
        fsdp::shard_group<fsdp::buffer<float>> g{comm, {}, {.plan = p}};
        for (std::size_t n : sizes) {
          ps.push_back(std::make_unique<fsdp::buffer<float>>(n));
          g.add_unit({ps.back().get()});
        }
        g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float>) {}));
      });
    } catch (const fsdp::error& e) {
      caught = e;
    }
    REQUIRE(caught.has_value());
    CHECK(caught->code() == fsdp::errc::invalid_argument);
    return std::string(caught->what());
  };
  CHECK(refused(std::vector<std::size_t>(3, 4096)).find("plan 'auto_bucket{.memory_limit = 0}': assigns 8 units, the group has 3") !=
        std::string::npos);
  std::vector<std::size_t> other(8, 4096);
  other[5] = 2048;  // half the bytes the trace had
  CHECK(refused(other).find("unit 5 has 8192 parameter bytes, the plan's trace 16384") != std::string::npos);
}

TEST_CASE("auto_bucket's plan and a manual plan through shard_group: the group replays them, with the reference's results") {
  using namespace fsdp_test;
  train_config cfg;
  cfg.opt = optimizer::adamw;
  cfg.steps = 4;
  const auto ref = train_reference(cfg);
  for (int n : {2, 4}) {
    CAPTURE(n);
    const step_trace t = mlp_trace(n);
    // Latency-bound: the greedy puts the 4 units in one bucket; a manual plan with 3 buckets.
    const plan automatic = fsdp::auto_bucket{}.plan_for(t, latency_bound());
    const plan manual = from_policies(t, {0, 1, 1, 2}, 2, 0, "manual");
    REQUIRE(automatic.unit_bytes == mlp_unit_bytes());

    using group = fsdp::shard_group<fsdp::buffer<float>>;
    CHECK(max_rel_diff(train_sharded<group>(n, cfg, {.plan = automatic}), ref) <= 1e-5);
    CHECK(max_rel_diff(train_sharded<group>(n, cfg, {.plan = manual}), ref) <= 1e-5);

    fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
      model<float> ma, mm;
      group ga{comm, {}, {.plan = automatic}};
      ma.register_with(ga);
      ga.finalize(per_shard_init());
      REQUIRE(ga.plan().has_value());
      CHECK(*ga.plan() == automatic);
      CHECK(ga.num_buckets() == static_cast<std::size_t>(automatic.num_buckets()));

      group gm{comm, {}, {.plan = manual}};
      mm.register_with(gm);
      gm.finalize(per_shard_init());
      REQUIRE(gm.plan().has_value());
      CHECK(*gm.plan() == manual);
      CHECK(gm.num_buckets() == 3);
    });
  }
}
