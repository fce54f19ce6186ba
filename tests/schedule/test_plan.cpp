// Plans: what from_policies and per_unit_prefetch produce (prefetch_plan, which the runtime also replays), bucket
// positions for non-sequential orders, and that invalid traces and plans throw fsdp::error
// naming the problem.

#include "fsdp/schedule/plan.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/policy/prefetch.hpp"
#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "schedule/common.hpp"

namespace {

using namespace fsdp::schedule;
using fsdp_test::catch_error;
using sched_test::equal_units;

void check_message(const fsdp::error& e, const std::string& part) {
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK_MESSAGE(std::string(e.what()).find(part) != std::string::npos, e.what());
}

}  // namespace

TEST_CASE("per_unit_prefetch: FSDP2's default, one bucket per unit, prefetch 1, one reduction in flight") {
  const step_trace t = equal_units(5, 100, 1, 1, 4, 4);
  const plan p = per_unit_prefetch(t);
  CHECK(p.bucket_of_unit == std::vector<int>{0, 1, 2, 3, 4});
  CHECK(p.forward_issue == std::vector<int>{0, 0, 1, 2, 3});     // bucket at position p: max(0, p - 1)
  CHECK(p.backward_issue == std::vector<int>{3, 2, 1, 0, 0});    // bucket 4 runs first in backward
  CHECK(p.reduce_wait == std::vector<int>{5, 4, 3, 2, 1});       // position + 1; 5 = finish_backward
  CHECK(p.num_buckets() == 5);
  validate(t, p);

  const plan none = per_unit_prefetch(t, 0, 2);
  CHECK(none.forward_issue == std::vector<int>{0, 1, 2, 3, 4});  // on demand
  CHECK(none.backward_issue == std::vector<int>{2, 1, 0, 0, 0});
}

TEST_CASE("from_policies: a BucketPolicy and a Prefetch policy give the same plan as their values") {
  const step_trace t = equal_units(6, 1000, 1, 1, 2, 2);  // 4000 bytes per unit in f32
  const plan p = from_policies(t, fsdp::fixed_bytes{.bytes = 8000}, fsdp::prefetch{.forward = 2, .backward = 1});
  CHECK(p.bucket_of_unit == std::vector<int>{0, 0, 1, 1, 2, 2});
  CHECK(p.forward_issue == std::vector<int>{0, 0, 0});
  CHECK(p.backward_issue == std::vector<int>{1, 0, 0});
  CHECK(p == from_policies(t, {0, 0, 1, 1, 2, 2}, 2, 1));
  CHECK(describe_buckets(p) == "from_policies: 3 buckets [0-1 | 2-3 | 4-5]");
  CHECK(from_policies(t, fsdp::per_unit{}, fsdp::no_prefetch(), "per_unit") == per_unit_prefetch(t, 0, 0));

  // An explicit order equal to the traced one is fine; another order cannot be modelled.
  CHECK_NOTHROW(from_policies(t, fsdp::per_unit{}, fsdp::prefetch{.forward_units = {0, 1, 2, 3, 4, 5}}));
  check_message(catch_error([&] {
                  from_policies(t, fsdp::per_unit{}, fsdp::prefetch{.forward_units = {1, 0, 2, 3, 4, 5}});
                }),
                "explicit unit order differs");
}

TEST_CASE("positions_of: bucket orders follow the traced orders, not registration") {
  step_trace t = equal_units(4, 100, 1, 1, 2, 2);
  t.forward_order = {2, 3, 0, 1};   // e.g. a decoder registered before the encoder it follows
  t.backward_order = {1, 0, 3, 2};
  const auto pos = positions_of(t, std::vector<int>{0, 0, 1, 1});
  CHECK(pos.forward == std::vector<int>{1, 0});
  CHECK(pos.backward == std::vector<int>{0, 1});
  CHECK(pos.forward_pos == std::vector<int>{1, 0});
  const plan p = from_policies(t, {0, 0, 1, 1}, 1, 1);
  CHECK(p.forward_issue == std::vector<int>{0, 0});
  CHECK(p.reduce_wait == std::vector<int>{1, 2});
  CHECK_NOTHROW(simulate(t, h100_nvlink(2), p));

  // Units 1 and 2 do not run back to back in forward: no bucket can hold them.
  check_message(catch_error([&] { positions_of(t, std::vector<int>{0, 1, 1, 2}); }), "do not run back to back");
}

TEST_CASE("validate(trace): each malformed trace throws naming the problem") {
  const step_trace good = equal_units(3, 100, 1, 1, 4, 2);
  CHECK_NOTHROW(validate(good));
  auto broken = [&](auto change, const std::string& message) {
    step_trace t = good;
    change(t);
    CAPTURE(message);
    check_message(catch_error([&] { validate(t); }), message);
  };
  broken([](step_trace& t) { t.units.clear(); t.forward_order.clear(); t.backward_order.clear(); }, "no units");
  broken([](step_trace& t) { t.forward_order = {0, 1, 1}; }, "forward order is not a permutation: unit 1 appears twice");
  broken([](step_trace& t) { t.backward_order = {2, 1}; }, "backward order has 2 entries for 3 units");
  broken([](step_trace& t) { t.forward_order = {0, 1, 7}; }, "names unit 7, which does not exist");
  broken([](step_trace& t) { t.units[1].param_numels = {10, 0}; }, "unit 1 ('u1') parameter 1 has 0 elements");
  broken([](step_trace& t) { t.units[2].param_numels.clear(); }, "unit 2 ('u2') has no parameters");
  broken([](step_trace& t) { t.units[0].backward_s = -1; }, "negative or not finite");
  broken([](step_trace& t) { t.shard_size = 3; }, "shard_size 3 does not divide world_size 4");
  broken([](step_trace& t) { t.world_size = 0; }, "world_size must be at least 1");
  broken([](step_trace& t) { t.param_elem = 0; }, "at least 1 byte");
  broken([](step_trace& t) { t.optimizer_states = -1; }, "optimizer_states");
  broken([](step_trace& t) { t.optimizer_s = std::nan(""); }, "optimizer_s is negative or not finite");
}

TEST_CASE("validate(trace, plan): each malformed plan throws naming the problem") {
  const step_trace t = equal_units(4, 100, 1, 1, 2, 2);
  const plan good = from_policies(t, {0, 0, 1, 2}, 1, 1, "mine");
  CHECK_NOTHROW(validate(t, good));
  auto broken = [&](auto change, const std::string& message) {
    plan p = good;
    change(p);
    CAPTURE(message);
    check_message(catch_error([&] { validate(t, p); }), message);
    check_message(catch_error([&] { simulate(t, h100_nvlink(2), p); }), message);
  };
  broken([](plan& p) { p.bucket_of_unit = {1, 1, 2, 3}; }, "must start at bucket 0");
  broken([](plan& p) { p.bucket_of_unit = {0, 2, 2, 3}; }, "consecutive units in buckets numbered 0, 1");
  broken([](plan& p) { p.bucket_of_unit = {0, 0, 1}; }, "bucket_of_unit has 3 entries for 4 units");
  broken([](plan& p) { p.forward_issue = {0, 0}; }, "plan 'mine': forward_issue has 2 entries for 3 buckets");
  broken([](plan& p) { p.forward_issue[1] = 2; }, "forward_issue[1] = 2 is outside [0, 1]");
  broken([](plan& p) { p.backward_issue[0] = -1; }, "backward_issue[0] = -1 is outside [0, 2]");
  broken([](plan& p) { p.reduce_wait[2] = 0; }, "reduce_wait[2] = 0 is outside [1, 3]");
  broken([](plan& p) { p.reduce_wait[0] = 4; }, "reduce_wait[0] = 4 is outside [3, 3]");
  check_message(catch_error([&] { from_policies(t, {0, 1, 2, 3}, -1, 1); }), "prefetch depths must be >= 0");
}

TEST_CASE("to_string: plans and cost models print every field") {
  const step_trace t = equal_units(2, 100, 1, 1, 2, 2);
  CHECK(to_string(per_unit_prefetch(t)) ==
        "plan{.name = \"per_unit\", .bucket_of_unit = [0, 1], .forward_issue = [0, 0], .backward_issue = [0, 0], "
        ".reduce_wait = [2, 1]}");
  const cost_model c{{1e-5, 2e9}, {2e-5, 3e9}, {0, 4e9}};
  CHECK(to_string(c) ==
        "cost_model{.all_gather = {.alpha_s = 1e-05, .beta_bytes_per_s = 2e+09}, .reduce_scatter = {.alpha_s = 2e-05, "
        ".beta_bytes_per_s = 3e+09}, .all_reduce = {.alpha_s = 0, .beta_bytes_per_s = 4e+09}}");
  check_message(catch_error([&] { validate(cost_model{{-1, 1}, {0, 1}, {0, 1}}); }), "all_gather.alpha_s");
  check_message(catch_error([&] { validate(cost_model{{0, 1}, {0, 0}, {0, 1}}); }), "reduce_scatter.beta_bytes_per_s");
}
