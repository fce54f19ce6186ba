// The transient memory bound on its own: before the order is known (every bucket counted as
// the largest) and position by position over a plan, worked out by hand.
#include "fsdp/detail/group/memory_bound.hpp"

#include <doctest/doctest.h>

#include <vector>

namespace {

using fsdp::detail::bucket_bytes;
using fsdp::detail::transient_memory_bound;

// Three buckets: gathered / gradient / reduction bytes.
const std::vector<bucket_bytes> bytes{{100, 100, 150}, {300, 300, 450}, {200, 200, 300}};

fsdp::schedule::bucket_positions in_order() {
  // Forward runs buckets 0, 1, 2; backward 2, 1, 0.
  return {{0, 1, 2}, {2, 1, 0}, {0, 1, 2}, {2, 1, 0}};
}

}  // namespace

TEST_CASE("memory bound before the order is known: (1 + depth) x the largest bucket, at most all of them") {
  const auto b = transient_memory_bound(bytes, true, nullptr, nullptr, 1, 1);
  CHECK(b.forward == 600);                // 2 x 300, all = 600
  CHECK(b.backward == 600 + 300 + 450);   // 2 x 300 + largest gradients + largest reduction
  const auto deep = transient_memory_bound(bytes, true, nullptr, nullptr, 5, 0);
  CHECK(deep.forward == 600);              // capped at every bucket
  CHECK(deep.backward == 300 + 300 + 450);
  const auto kept = transient_memory_bound(bytes, false, nullptr, nullptr, 0, 0);
  CHECK(kept.forward == 600);              // reshard_after_forward = false keeps them all
  CHECK(kept.backward == 600 + 300 + 450);
}

TEST_CASE("memory bound position by position over a plan, worked out by hand") {
  const auto pos = in_order();
  // Prefetch 1, one reduction in flight.
  const fsdp::schedule::plan p1{"p1", {0, 1, 2}, {0, 0, 1}, {1, 0, 0}, {3, 2, 1}};
  const auto b = transient_memory_bound(bytes, true, &pos, &p1, 1, 1);
  // Forward: position 0 holds buckets 0+1 (400), 1 holds 1+2 (500), 2 holds 2 (200).
  CHECK(b.forward == 500);
  // Backward positions: 0 = bucket 2, 1 = bucket 1, 2 = bucket 0.
  //   p0: gathered 2+1 (500) + grad 2 (200) = 700; after: gathered 1 (300) + red 2 (300) = 600
  //   p1: gathered 1+0 (400) + grad 1 (300) + red 2 (waited at 1: 300) = 1000;
  //       after: gathered 0 (100) + red 1 (450) = 550
  //   p2: gathered 0 (100) + grad 0 (100) + red 1 (waited at 2: 450) = 650; after: red 0 (150)
  CHECK(b.backward == 1000);
  // Everything gathered at position 0 and every reduction in flight until the end.
  const fsdp::schedule::plan all{"all", {0, 1, 2}, {0, 0, 0}, {0, 0, 0}, {3, 3, 3}};
  const auto a = transient_memory_bound(bytes, true, &pos, &all, 1, 1);
  CHECK(a.forward == 600);
  //   p0: gathered all (600) + grad 2 (200) = 800
  //   p1: gathered 1+0 (400) + grad 1 (300) + red 2 (300) = 1000
  //   p2: gathered 0 (100) + grad 0 (100) + red 2 + red 1 (750) = 950; after: all three (900)
  CHECK(a.backward == 1000);
}

TEST_CASE("memory bound of a user's plan before the order is known: every bucket gathered, every reduction in flight") {
  const fsdp::schedule::plan p1{"p1", {0, 1, 2}, {0, 0, 1}, {1, 0, 0}, {3, 2, 1}};
  const auto b = transient_memory_bound(bytes, true, nullptr, &p1, 1, 1);
  CHECK(b.forward == 600);
  CHECK(b.backward == 600 + 300 + (150 + 450 + 300));
}
