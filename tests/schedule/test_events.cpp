// Hook events in the trace: derive_events writes out what a trace without events means (and
// simulating it gives exactly the same result), unit_times_from_events charges compute as
// shard_group's unit timings do, and events that are unbalanced, mis-nested, out of order or
// out of range throw fsdp::error naming the problem.

#include "fsdp/schedule/trace.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/planner.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "schedule/common.hpp"

namespace {

using namespace fsdp::schedule;
using fsdp_test::catch_error;
using sched_test::equal_units;
using sched_test::nested_units;

void check_message(const fsdp::error& e, const std::string& part) {
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
}

// Every field of two results, compared exactly (not approximately).
void check_identical(const sim_result& a, const sim_result& b) {
  CHECK(a.step_s == b.step_s);
  CHECK(a.forward_s == b.forward_s);
  CHECK(a.backward_s == b.backward_s);
  CHECK(a.optimizer_s == b.optimizer_s);
  CHECK(a.compute_s == b.compute_s);
  CHECK(a.exposed_comm_s == b.exposed_comm_s);
  CHECK(a.comm_busy_s == b.comm_busy_s);
  CHECK(a.persistent_bytes == b.persistent_bytes);
  CHECK(a.peak_transient_bytes == b.peak_transient_bytes);
  CHECK(a.forward_peak_transient_bytes == b.forward_peak_transient_bytes);
  CHECK(a.backward_peak_transient_bytes == b.backward_peak_transient_bytes);
  CHECK(a.peak_bytes == b.peak_bytes);
  REQUIRE(a.collectives.size() == b.collectives.size());
  for (std::size_t i = 0; i < a.collectives.size(); ++i) {
    const auto &x = a.collectives[i], &y = b.collectives[i];
    CHECK(x.kind == y.kind);
    CHECK(x.bucket == y.bucket);
    CHECK(x.phase == y.phase);
    CHECK(x.issue_s == y.issue_s);
    CHECK(x.start_s == y.start_s);
    CHECK(x.end_s == y.end_s);
    CHECK(x.bytes == y.bytes);
  }
}

}  // namespace

TEST_CASE("derive_events: pre u, the unit's compute, post u, in each pass's order, and given lists stay") {
  step_trace t = equal_units(3, 100, 1.5, 2.5, 2, 2);
  t.backward_order = {2, 0, 1};
  t.units[1].forward_s = 7;
  derive_events(t);
  CHECK(t.forward_events == std::vector<hook_event>{{0, true, 0}, {0, false, 1.5}, {1, true, 0}, {1, false, 7},
                                                    {2, true, 0}, {2, false, 1.5}});
  CHECK(t.backward_events == std::vector<hook_event>{{2, true, 0}, {2, false, 2.5}, {0, true, 0}, {0, false, 2.5},
                                                     {1, true, 0}, {1, false, 2.5}});
  CHECK_NOTHROW(validate(t));

  step_trace n = nested_units(2, 100, 2, 2);
  const auto given = n.forward_events;
  n.backward_events.clear();
  derive_events(n);
  CHECK(n.forward_events == given);  // kept
  CHECK(n.backward_events.size() == 6);
  CHECK(n.backward_events.front() == hook_event{0, true, 0});
  CHECK(n.backward_events[1] == hook_event{0, false, n.units[0].backward_s});
}

TEST_CASE("derive_events: the written-out trace simulates exactly as the trace without events (random traces, fixed seed)") {
  std::mt19937 rng(0xe7e47u);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int k = 0; k < 25; ++k) {
    CAPTURE(k);
    step_trace t;
    const int n = pick(1, 8);
    for (int u = 0; u < n; ++u)
      t.units.push_back({"", {static_cast<std::size_t>(pick(1, 5000)), static_cast<std::size_t>(pick(1, 50))},
                         uniform(0.01, 2), uniform(0.02, 4)});
    use_registration_order(t);
    t.world_size = 4;
    t.shard_size = pick(0, 2) == 0 ? 2 : 4;
    t.reshard_after_forward = pick(0, 3) != 0;
    t.param_elem = pick(0, 1) ? 2 : 4;
    t.optimizer_s = uniform(0, 0.3);
    t.backward_tail_s = uniform(0, 0.3);
    const link_cost l{uniform(0, 0.5), 4000.0 * uniform(0.5, 5)};
    const cost_model c{l, l, {uniform(0, 0.5), 3000.0}};
    step_trace written = t;
    derive_events(written);
    REQUIRE(written.forward_events.size() == 2 * static_cast<std::size_t>(n));
    std::vector<plan> plans{per_unit_prefetch(t, 0, 0), per_unit_prefetch(t, 1, 1), per_unit_prefetch(t, 2, 1),
                            greedy_plan(t, c, std::numeric_limits<std::size_t>::max())};
    for (const plan& p : plans) {
      CAPTURE(to_string(p));
      check_identical(simulate(t, c, p), simulate(written, c, p));
    }
    // And the planners see the same step.
    CHECK(greedy_plan(written, c, std::numeric_limits<std::size_t>::max()) == plans.back());
  }
}

TEST_CASE("unit_times_from_events: compute goes to the innermost open unit, as shard_group's unit timings") {
  step_trace t = nested_units(3, 100, 2, 2,
                              {.embed = 1, .block_fwd = 3, .head = 2, .loss = 0.5, .head_bwd = 2.5, .block_bwd = 4, .embed_bwd = 1});
  for (auto& u : t.units) u.forward_s = u.backward_s = 99;
  unit_times_from_events(t);
  CHECK(t.units[0].forward_s == doctest::Approx(3.0));   // embedding + head
  CHECK(t.units[0].backward_s == doctest::Approx(3.5));  // head + embedding backward; the loss is nobody's
  for (int u = 1; u <= 3; ++u) {
    CHECK(t.units[static_cast<std::size_t>(u)].forward_s == doctest::Approx(3.0));
    CHECK(t.units[static_cast<std::size_t>(u)].backward_s == doctest::Approx(4.0));
  }
  // A pass without events keeps its times.
  t.backward_events.clear();
  t.units[2].backward_s = 42;
  unit_times_from_events(t);
  CHECK(t.units[2].backward_s == 42);
}

TEST_CASE("validate(trace): unbalanced, mis-nested, repeated, out-of-order and out-of-range events name the problem") {
  const step_trace good = nested_units(3, 100, 2, 2);
  CHECK_NOTHROW(validate(good));
  auto broken = [&](auto change, const std::string& message) {
    step_trace t = good;
    change(t);
    CAPTURE(message);
    check_message(catch_error([&] { validate(t); }), message);
    check_message(catch_error([&] { simulate(t, h100_nvlink(2), per_unit_prefetch(good)); }), message);
  };
  using E = std::vector<hook_event>;
  // Forward of `good`: pre 0, pre 1, post 1, pre 2, post 2, pre 3, post 3, post 0.
  broken([](step_trace& t) { t.forward_events.pop_back(); },
         "the forward events leave unit 0 open (unbalanced: its pre has no post)");
  broken([](step_trace& t) { t.forward_events[2] = {2, false, 3}; },
         "forward event 2 is the post of unit 2, which has no open pre (unbalanced");
  broken([](step_trace& t) {
           t.forward_events = E{{0, true, 0}, {1, true, 0}, {0, false, 0}, {1, false, 0},
                                {2, true, 0}, {2, false, 0}, {3, true, 0}, {3, false, 0}};
         },
         "forward event 2 is the post of unit 0 while unit 1, opened inside it, is still open (mis-nested");
  broken([](step_trace& t) { t.backward_events[7] = {2, false, 1}; },
         "backward event 7 is the post of unit 2, which has no open pre");
  broken([](step_trace& t) { t.backward_events.insert(t.backward_events.begin() + 3, hook_event{3, true, 0}); },
         "backward event 3 is a second pre of unit 3 (each unit runs once per pass");
  broken([](step_trace& t) {  // blocks 2 and 3 swapped
           t.forward_events[3].unit = t.forward_events[4].unit = 3;
           t.forward_events[5].unit = t.forward_events[6].unit = 2;
         },
         "forward event 3 is the pre of unit 3, but forward_order runs unit 2 there (the pres must follow forward_order)");
  broken([](step_trace& t) {  // block 3 missing
           t.forward_events.resize(5);
           t.forward_events.push_back({0, false, 0});
         },
         "the forward events hold the pres of 3 units, forward_order has 4");
  broken([](step_trace& t) { t.backward_events[1].unit = 9; },
         "backward event 1 names unit 9, which does not exist (4 units)");
  broken([](step_trace& t) { t.forward_events[1].compute_s = -1; },
         "forward event 1 (pre of unit 1) has a compute_s that is negative or not finite");
  broken([](step_trace& t) { t.backward_events[2].compute_s = std::nan(""); },
         "backward event 2 (post of unit 3) has a compute_s that is negative");
  broken([](step_trace& t) { t.backward_tail_s = std::numeric_limits<double>::infinity(); },
         "backward_tail_s is negative or not finite");
}

TEST_CASE("positions_of: in a nested trace a bucket's units must still be back to back in the pres' order") {
  const step_trace t = nested_units(3, 100, 2, 2);
  // Forward pres 0, 1, 2, 3; backward pres 0, 3, 2, 1: 0 and 1 are apart in backward.
  const auto e = catch_error([&] { positions_of(t, std::vector<int>{0, 0, 1, 2}); });
  check_message(e, "bucket 0's units do not run back to back in the backward order");
  // Blocks together, or everything in one bucket, are fine.
  const auto pos = positions_of(t, std::vector<int>{0, 1, 1, 1});
  CHECK(pos.backward == std::vector<int>{0, 1});
  CHECK_NOTHROW(positions_of(t, std::vector<int>{0, 0, 0, 0}));
}
