// The planning BucketPolicies: auto_bucket carries its trace and cost model by value and is
// per-unit (no plan) until both are set; planned replays a plan as it is. Both through their
// BucketPolicy functions and through shard_group, which replays the plan they give.

#include "fsdp/schedule/auto_bucket.hpp"

#include <doctest/doctest.h>

#include <cstddef>
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

TEST_CASE("auto_bucket: per-unit and no plan until both trace and cost are set, then the planner's plan") {
  const std::vector<std::size_t> bytes(8, 4096 * 4);
  const fsdp::bucket_request request{bytes};
  const step_trace t = eight_units();
  const cost_model c = latency_bound();
  const std::size_t limit = std::size_t{1} << 30;

  fsdp::auto_bucket a{.memory_limit = limit};
  CHECK_FALSE(a.plan(request).has_value());
  CHECK(a.assign(request) == fsdp::per_unit{}.assign(request));
  a.trace = t;  // a trace alone is not enough
  CHECK_FALSE(a.plan(request).has_value());
  CHECK(a.assign(request) == fsdp::per_unit{}.assign(request));
  a.trace.reset();
  a.cost = c;  // nor a cost model alone
  CHECK_FALSE(a.plan(request).has_value());

  a.trace = t;
  const std::optional<plan> p = a.plan(request);
  REQUIRE(p.has_value());
  plan greedy = greedy_plan(t, c, limit);
  greedy.name = "auto_bucket{.memory_limit = 1073741824}";
  CHECK(*p == greedy);
  CHECK(p->num_buckets() == 1);
  CHECK(a.assign(request) == p->bucket_of_unit);
  CHECK(*p == a.plan_for(t, c));
  CHECK(simulate(t, c, *p).peak_bytes <= limit);

  // .search: best_plan's search.
  fsdp::auto_bucket s = a;
  s.search = true;
  plan best = best_plan(t, c, limit);
  best.name = "auto_bucket{.memory_limit = 1073741824, .search = true}";
  CHECK(*s.plan(request) == best);
  CHECK(fsdp::auto_bucket{}.plan_for(t, c).num_buckets() == 1);  // no limit

  // A trace of other units is refused, naming what differs.
  const std::vector<std::size_t> three(3, 4096 * 4);
  const fsdp::error e = catch_error([&] { a.plan(fsdp::bucket_request{three}); });
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK(std::string(e.what()).find("the trace has 8 units, the request 3") != std::string::npos);
  std::vector<std::size_t> other = bytes;
  other[5] = 4096 * 2;  // bf16 handles, f32 trace
  const fsdp::error f = catch_error([&] { a.assign(fsdp::bucket_request{other}); });
  CHECK(std::string(f.what()).find("unit 5 has 8192 parameter bytes, the trace 16384") != std::string::npos);
}

TEST_CASE("auto_bucket: equality compares the trace and the cost model, and to_string says what is set") {
  const step_trace t = eight_units();
  const cost_model c = latency_bound();
  const fsdp::auto_bucket a{.memory_limit = std::size_t{1} << 30};
  CHECK(to_string(a) == "auto_bucket{.memory_limit = 1073741824}");
  CHECK(to_string(fsdp::auto_bucket{.memory_limit = 5, .search = true}) == "auto_bucket{.memory_limit = 5, .search = true}");
  CHECK(a == fsdp::auto_bucket{.memory_limit = std::size_t{1} << 30});
  CHECK_FALSE(a == fsdp::auto_bucket{});

  const fsdp::auto_bucket full{.memory_limit = 5, .trace = t, .cost = c};
  CHECK(to_string(full) == "auto_bucket{.memory_limit = 5, .trace = {8 units}, .cost = " + to_string(c) + "}");
  CHECK(to_string(fsdp::auto_bucket{.trace = t}) == "auto_bucket{.memory_limit = 0, .trace = {8 units}}");
  CHECK(full == fsdp::auto_bucket{.memory_limit = 5, .trace = t, .cost = c});
  CHECK_FALSE(full == fsdp::auto_bucket{.memory_limit = 5, .trace = t});
  step_trace slower = t;
  slower.units[3].backward_s += 1;
  CHECK_FALSE(full == fsdp::auto_bucket{.memory_limit = 5, .trace = slower, .cost = c});
  step_trace with_events = t;
  derive_events(with_events);  // the same step written out is still another value
  CHECK_FALSE(full == fsdp::auto_bucket{.memory_limit = 5, .trace = with_events, .cost = c});
  cost_model cheaper = c;
  cheaper.all_reduce.alpha_s = 1;
  CHECK_FALSE(full == fsdp::auto_bucket{.memory_limit = 5, .trace = t, .cost = cheaper});
}

TEST_CASE("planned: a manual plan round-trips as assign() and plan()") {
  const step_trace t = equal_units(4, 100, 1, 1, 2, 2);
  const plan p = from_policies(t, {0, 0, 1, 2}, 2, 1, "manual");
  const fsdp::planned m{p};
  const std::vector<std::size_t> bytes(4, 400);
  CHECK(m.assign(fsdp::bucket_request{bytes}) == p.bucket_of_unit);
  REQUIRE(m.plan(fsdp::bucket_request{bytes}).has_value());
  CHECK(*m.plan(fsdp::bucket_request{bytes}) == p);
  CHECK(m == fsdp::planned{p});
  CHECK_FALSE(m == fsdp::planned{per_unit_prefetch(t)});
  CHECK(to_string(m) == "planned{" + to_string(p) + "}");
  const std::vector<std::size_t> five(5, 400);
  const fsdp::error e = catch_error([&] { m.plan(fsdp::bucket_request{five}); });
  CHECK(std::string(e.what()).find("planned: plan 'manual' assigns 4 units, the request has 5") != std::string::npos);
  CHECK_THROWS_AS(m.assign(fsdp::bucket_request{five}), fsdp::error);
}

TEST_CASE("auto_bucket and planned through shard_group: the group replays their plan, with the reference's results") {
  using namespace fsdp_test;
  train_config cfg;
  cfg.opt = optimizer::adamw;
  cfg.steps = 4;
  const auto ref = train_reference(cfg);
  const std::vector<std::size_t> bytes = mlp_unit_bytes();
  for (int n : {2, 4}) {
    CAPTURE(n);
    const step_trace t = mlp_trace(n);
    // Latency-bound: the greedy puts the 4 units in one bucket; a manual plan with 3 buckets.
    const fsdp::auto_bucket a{.trace = t, .cost = latency_bound()};
    const plan expect = *a.plan(fsdp::bucket_request{bytes});
    const fsdp::planned m{from_policies(t, {0, 1, 1, 2}, 2, 0, "manual")};

    using auto_group = fsdp::shard_group<fsdp::buffer<float>, fsdp::full_shard, fsdp::auto_bucket>;
    using planned_group = fsdp::shard_group<fsdp::buffer<float>, fsdp::full_shard, fsdp::planned>;
    CHECK(max_rel_diff(train_sharded<auto_group>(n, cfg, {.bucket = a}), ref) <= 1e-5);
    CHECK(max_rel_diff(train_sharded<planned_group>(n, cfg, {.bucket = m}), ref) <= 1e-5);

    fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
      model<float> ma, mm, mp;
      auto_group ga{comm, {}, {.bucket = a}};
      ma.register_with(ga);
      ga.finalize(per_shard_init());
      REQUIRE(ga.plan().has_value());
      CHECK(*ga.plan() == expect);
      CHECK(ga.num_buckets() == static_cast<std::size_t>(expect.num_buckets()));

      planned_group gm{comm, {}, {.bucket = m}};
      mm.register_with(gm);
      gm.finalize(per_shard_init());
      REQUIRE(gm.plan().has_value());
      CHECK(*gm.plan() == m.value);
      CHECK(gm.num_buckets() == 3);

      // Without a trace auto_bucket has no plan: per-unit buckets and the Prefetch policy.
      auto_group gp{comm, {}, {.bucket = {.memory_limit = 1}}};
      mp.register_with(gp);
      gp.finalize(per_shard_init());
      CHECK_FALSE(gp.plan().has_value());
      CHECK(gp.num_buckets() == 4);
    });
  }
}
