// step_order on its own (pure host code): the first step's record, bucket positions, the plan
// replayed over them (prefetch depths or a user's plan), the all-gathers each pre-hook issues
// and the reductions waited for before the next is issued.
#include "fsdp/detail/group/step_order.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "common/catch_error.hpp"

namespace {

using fsdp::detail::step_order;
using fsdp_test::catch_error;
using ints = std::vector<int>;

ints list(std::span<const int> s) { return {s.begin(), s.end()}; }

// 4 units in 3 buckets {0}, {1, 2}, {3}.
const ints buckets{0, 1, 1, 2};

}  // namespace

TEST_CASE("step_order: nothing is prefetched and every reduction is waited for until an order is known") {
  step_order o(0, fsdp::prefetch{.forward = 2, .backward = 2}, std::nullopt);
  CHECK_FALSE(o.known());
  CHECK_FALSE(o.plan().has_value());
  CHECK(o.gathers_after(0, false).empty());
  CHECK(o.gathers_after(1, true).empty());
  const ints pending{2, 1};
  CHECK(o.reductions_due(0, pending) == 2);
}

TEST_CASE("step_order: the record of the first forward and backward, and what is not part of it") {
  step_order o(0, fsdp::prefetch{}, std::nullopt);
  for (int u : {0, 1}) o.record_forward(u);
  o.forget_forward_only_pass();  // an evaluation pass before the first backward
  for (int u : {0, 1, 2, 3}) o.record_forward(u);
  for (int u : {3, 2, 1, 0}) o.record_backward(u);
  o.record_forward(0);  // the second step: recording has ended
  o.forget_forward_only_pass();  // after a backward, nothing is forgotten
  CHECK(o.describe_recorded() == "forward [0, 1, 2, 3], backward [3, 2, 1, 0]");
  CHECK(o.encode_recorded() == ints{0, 1, 2, 3, -1, 3, 2, 1, 0});
  CHECK_FALSE(o.recorded_checked());
  o.recorded_agrees(buckets);
  CHECK(o.recorded_checked());
  CHECK(o.known());
  CHECK(list(o.forward_units()) == ints{0, 1, 2, 3});
  CHECK(list(o.backward_units()) == ints{3, 2, 1, 0});
}

TEST_CASE("step_order: prefetch depths become schedule::prefetch_plan over the followed order") {
  for (const auto& [forward, backward] : {std::pair{0, 0}, std::pair{1, 1}, std::pair{2, 1}}) {
    CAPTURE(forward);
    CAPTURE(backward);
    step_order o(0, fsdp::prefetch{.forward = forward, .backward = backward}, std::nullopt);
    o.follow({0, 1, 2, 3}, {3, 2, 1, 0}, buckets);
    REQUIRE(o.plan().has_value());
    CHECK(o.positions().forward == ints{0, 1, 2});
    CHECK(o.positions().backward == ints{2, 1, 0});
    CHECK(o.positions().backward_pos == ints{2, 1, 0});
    // Worked out by hand: the bucket at position p is issued at max(0, p - depth).
    ints fwd_issue(3), bwd_issue(3);
    for (int p = 0; p < 3; ++p) {
      fwd_issue[static_cast<std::size_t>(p)] = std::max(0, p - forward);
      bwd_issue[static_cast<std::size_t>(2 - p)] = std::max(0, p - backward);
    }
    CHECK(o.plan()->forward_issue == fwd_issue);
    CHECK(o.plan()->backward_issue == bwd_issue);
    CHECK(o.plan()->reduce_wait == ints{3, 2, 1});  // backward position + 1: one in flight
    // What each pre-hook issues after its own all-gather.
    if (forward == 0) CHECK(o.gathers_after(0, false).empty());
    if (forward == 1) CHECK(list(o.gathers_after(0, false)) == ints{1});
    if (forward == 2) CHECK(list(o.gathers_after(0, false)) == ints{1, 2});
    if (forward >= 1) CHECK(list(o.gathers_after(1, false)) == (forward == 1 ? ints{2} : ints{}));
    CHECK(o.gathers_after(2, false).empty());
    if (backward == 1) CHECK(list(o.gathers_after(2, true)) == ints{1});
  }
}

TEST_CASE("step_order: reductions due before the next is issued") {
  // Default: one in flight. Bucket 2 (backward position 0) reduced; issuing bucket 1's (position
  // 1) first waits for it, since its wait position is 1.
  step_order o(0, fsdp::prefetch{}, std::nullopt);
  o.follow({0, 1, 2, 3}, {3, 2, 1, 0}, buckets);
  CHECK(o.reductions_due(1, ints{2}) == 1);
  CHECK(o.reductions_due(0, ints{}) == 0);
  // A plan that lets every reduction run until finish_backward waits for none.
  const fsdp::schedule::plan all_in_flight{"all", buckets, {0, 1, 2}, {2, 1, 0}, {3, 3, 3}};
  step_order p(0, fsdp::prefetch{}, all_in_flight);
  p.follow({0, 1, 2, 3}, {3, 2, 1, 0}, buckets);
  CHECK(p.reductions_due(0, ints{2, 1}) == 0);
  // Bucket 2's reduction due at position 1, bucket 1's at 3: only the oldest is waited for.
  const fsdp::schedule::plan mixed{"mixed", buckets, {0, 1, 2}, {2, 1, 0}, {3, 3, 1}};
  step_order m(0, fsdp::prefetch{}, mixed);
  m.follow({0, 1, 2, 3}, {3, 2, 1, 0}, buckets);
  CHECK(m.reductions_due(0, ints{2, 1}) == 1);
}

TEST_CASE("step_order: a user's plan is checked against the units and against the order") {
  const std::vector<std::size_t> bytes{256, 512, 512, 256};
  auto what = [&](fsdp::schedule::plan p) {
    return std::string(catch_error([&] { step_order::check_plan(p, bytes, 3); }).what());
  };
  const fsdp::schedule::plan good{"good", buckets, {0, 1, 2}, {2, 1, 0}, {3, 2, 1}};
  CHECK_NOTHROW(step_order::check_plan(good, bytes, 3));
  auto p = good;
  p.bucket_of_unit = {0, 1, 2};
  CHECK(what(p).find("plan 'good': assigns 3 units, the group has 4") != std::string::npos);
  p = good;
  p.reduce_wait.pop_back();
  CHECK(what(p).find("needs one forward_issue, backward_issue and reduce_wait per bucket (3)") != std::string::npos);
  p = good;
  p.forward_issue[1] = -1;
  CHECK(what(p).find("bucket 1 has a position out of range") != std::string::npos);
  p = good;
  p.unit_bytes = {256, 512, 1024, 256};
  CHECK(what(p).find("unit 2 has 512 parameter bytes, the plan's trace 1024") != std::string::npos);
  CHECK(catch_error([&] { step_order::check_plan(p, bytes, 3); }).rank() == 3);

  // Positions are known only once an order is followed.
  step_order late(0, fsdp::prefetch{}, fsdp::schedule::plan{"late", buckets, {0, 2, 2}, {2, 1, 0}, {3, 2, 1}});
  const auto e = catch_error([&] { late.follow({0, 1, 2, 3}, {3, 2, 1, 0}, buckets); });
  CHECK(std::string(e.what()).find("bucket 1's forward all-gather is issued at position 2, after its own position 1") != std::string::npos);
  step_order early(0, fsdp::prefetch{}, fsdp::schedule::plan{"early", buckets, {0, 1, 2}, {2, 1, 0}, {3, 1, 1}});
  const auto f = catch_error([&] { early.follow({0, 1, 2, 3}, {3, 2, 1, 0}, buckets); });
  CHECK(std::string(f.what()).find("bucket 1's reduction must be waited for after its own backward position 1, not at 1") != std::string::npos);
}

TEST_CASE("step_order: an explicit Prefetch order is followed from the start and must name existing units") {
  step_order o(0, fsdp::prefetch{.forward = 1, .backward = 1, .forward_units = {0, 1, 2, 3}}, std::nullopt);
  o.follow_explicit_order(4, buckets);
  CHECK(o.known());
  CHECK(list(o.backward_units()) == ints{3, 2, 1, 0});  // the reverse of the forward order
  CHECK(list(o.gathers_after(0, false)) == ints{1});
  step_order none(0, fsdp::prefetch{}, std::nullopt);
  none.follow_explicit_order(4, buckets);
  CHECK_FALSE(none.known());
  step_order bad(0, fsdp::prefetch{.backward_units = {3, 7}}, std::nullopt);
  const auto e = catch_error([&] { bad.follow_explicit_order(4, buckets); });
  CHECK(std::string(e.what()).find("prefetch backward order names unit 7, which does not exist") != std::string::npos);
}
