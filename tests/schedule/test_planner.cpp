// Planners: the greedy buckets when collectives are latency-bound and not when they are
// bandwidth-bound, stays under the memory limit (bucketing less as it tightens), and says so
// when nothing fits; the search is never slower than greedy or FSDP2's per-unit plan, on random
// traces with a fixed seed; on a nested (GPT-shaped) trace both stay under the limit the
// simulator measures with bucket 0 held throughout. (auto_bucket: test_auto_bucket.cpp.)

#include "fsdp/schedule/planner.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/catch_error.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "schedule/common.hpp"

namespace {

using namespace fsdp::schedule;
using fsdp_test::catch_error;
using sched_test::equal_units;
using sched_test::nested_units;

// 8 units of 4096 f32 on 8 ranks: shard 512, an all-gather or reduce-scatter sends
// 512 * 4 * 7 = 14336 bytes.
constexpr double unit_bytes_sent = 14336;

step_trace eight_units() { return equal_units(8, 4096, 1.0, 2.0, 8, 8); }

// Every collective costs 1 s, all of it bandwidth: exactly as long as a unit's forward.
cost_model bandwidth_bound() {
  const link_cost l{0.0, unit_bytes_sent};
  return {l, l, l};
}
// Every collective costs 10 s, all of it latency.
cost_model latency_bound() {
  const link_cost l{10.0, 1e30};
  return {l, l, l};
}

constexpr std::size_t no_limit = ~std::size_t{0};

}  // namespace

TEST_CASE("greedy_plan: one bucket per unit when the bandwidth term already hides, few buckets when latency dominates") {
  const step_trace t = eight_units();
  const plan bw = greedy_plan(t, bandwidth_bound(), no_limit);
  CHECK(bw.num_buckets() == 8);
  CHECK(bw.name == "greedy");
  validate(t, bw);

  const plan lat = greedy_plan(t, latency_bound(), no_limit);
  CHECK(lat.num_buckets() < bw.num_buckets());
  CHECK(lat.num_buckets() == 1);
  // And bucketing pays off there: fewer alphas on the link.
  CHECK(simulate(t, latency_bound(), lat).step_s < simulate(t, latency_bound(), per_unit_prefetch(t)).step_s);
}

TEST_CASE("greedy_plan: respects the memory limit and buckets less as it tightens") {
  const step_trace t = eight_units();
  const cost_model c = latency_bound();
  const std::size_t per_unit_peak = simulate(t, c, per_unit_prefetch(t)).peak_bytes;
  const std::size_t loose = simulate(t, c, greedy_plan(t, c, no_limit)).peak_bytes;
  REQUIRE(loose > per_unit_peak);
  int previous = 0;
  for (const std::size_t limit : {loose, (loose + per_unit_peak) / 2, per_unit_peak + 2 * 4096 * 4, per_unit_peak}) {
    CAPTURE(limit);
    const plan p = greedy_plan(t, c, limit);
    const sim_result r = simulate(t, c, p);
    CHECK(r.peak_bytes <= limit);
    CHECK(p.num_buckets() >= previous);  // a tighter limit never gives fewer buckets
    previous = p.num_buckets();
  }
  CHECK(previous == 8);  // at FSDP2's own peak, FSDP2's buckets
  CHECK(greedy_plan(t, c, loose).num_buckets() == 1);

  // Between the lean plan (no prefetch) and FSDP2's: the greedy drops prefetching to fit.
  const std::size_t lean = simulate(t, c, per_unit_prefetch(t, 0, 0)).peak_bytes;
  REQUIRE(lean < per_unit_peak);
  const plan p = greedy_plan(t, c, lean);
  CHECK(simulate(t, c, p).peak_bytes <= lean);
  CHECK(p.forward_issue == per_unit_prefetch(t, 0, 0).forward_issue);
}

TEST_CASE("planners: when no plan fits, the error names the smallest achievable peak and the limit") {
  const step_trace t = eight_units();
  const cost_model c = latency_bound();
  const std::size_t lean = simulate(t, c, per_unit_prefetch(t, 0, 0)).peak_bytes;
  for (int which = 0; which < 2; ++which) {
    const fsdp::error e = catch_error([&] {
      if (which == 0) greedy_plan(t, c, lean - 1);
      else best_plan(t, c, lean - 1);
    });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    const std::string what = e.what();
    CHECK_MESSAGE(what.find("memory limit of " + std::to_string(lean - 1) + " bytes") != std::string::npos, what);
    CHECK_MESSAGE(what.find("smallest peak achievable is " + std::to_string(lean) + " bytes") != std::string::npos, what);
  }
}

TEST_CASE("best_plan: never slower than greedy or per-unit, always under the limit (random traces, fixed seed)") {
  std::mt19937 rng(0x5c4edu);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); };
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  int strictly_better = 0, cases = 0;
  for (int k = 0; k < 40; ++k) {
    step_trace t;
    const int n = pick(2, 10);
    for (int u = 0; u < n; ++u) {
      unit_profile p;
      for (int i = pick(1, 3); i > 0; --i) p.param_numels.push_back(static_cast<std::size_t>(pick(1, 6000)));
      p.forward_s = uniform(0.05, 2.0);
      p.backward_s = p.forward_s * uniform(1.5, 2.5);
      t.units.push_back(p);
    }
    use_registration_order(t);
    const int worlds[] = {2, 4, 8};
    t.world_size = worlds[pick(0, 2)];
    const int shape = pick(0, 5);
    t.shard_size = shape == 0 ? 1 : shape == 1 ? t.world_size / 2 : t.world_size;
    t.reshard_after_forward = pick(0, 3) != 0;
    t.param_elem = pick(0, 1) ? 2 : 4;
    t.optimizer_s = uniform(0, 0.5);
    // One unit's all-gather takes 0.1 to 3 s of bandwidth, plus 0 to 2 s of latency.
    const double beta = 2000.0 * t.param_elem * uniform(0.3, 10.0);
    const link_cost l{uniform(0, 2), beta};
    const cost_model c{l, {uniform(0, 2), beta}, {uniform(0, 2), beta}};
    const plan fsdp2 = per_unit_prefetch(t);
    const sim_result base = simulate(t, c, fsdp2);
    const auto limit = static_cast<std::size_t>(static_cast<double>(base.peak_bytes) * uniform(1.0, 1.6));
    CAPTURE(k);
    CAPTURE(to_string(c));
    const plan g = greedy_plan(t, c, limit);
    const plan b = best_plan(t, c, limit, {.max_evaluations = 3000});
    validate(t, b);
    CHECK(b.name == "best");
    const sim_result rg = simulate(t, c, g), rb = simulate(t, c, b);
    CHECK(rg.peak_bytes <= limit);
    CHECK(rb.peak_bytes <= limit);
    CHECK(rb.step_s <= rg.step_s * (1 + 1e-12));
    CHECK(rb.step_s <= base.step_s * (1 + 1e-12));
    ++cases;
    if (rb.step_s < std::min(rg.step_s, base.step_s) * (1 - 1e-9)) ++strictly_better;
  }
  CHECK(cases == 40);
  // The search is not a no-op: it beats both starting points on a good share of the traces.
  MESSAGE("best_plan beat both greedy and per-unit on " << strictly_better << " of " << cases << " traces");
  CHECK(strictly_better >= 10);
}

TEST_CASE("planners: on a nested trace (unit 0 around 8 blocks) plans are valid and under the limit the events imply") {
  // Latency-bound, so bucketing pays; unit 0 cannot share a bucket with some blocks only (it
  // runs first in backward, block 1 last).
  const step_trace t = nested_units(
      8, 4096, 8, 8, {.embed = 0.5, .block_fwd = 1, .head = 1, .loss = 0.2, .head_bwd = 1, .block_bwd = 2, .embed_bwd = 0.5});
  const cost_model c = latency_bound();
  const sim_result base = simulate(t, c, per_unit_prefetch(t));
  step_trace flat = t;
  flat.forward_events.clear();
  flat.backward_events.clear();
  // Holding bucket 0 around the blocks costs memory the flat trace does not see.
  REQUIRE(simulate(flat, c, per_unit_prefetch(flat)).peak_bytes < base.peak_bytes);
  for (const std::size_t limit : {base.peak_bytes, base.peak_bytes + 4 * 4096 * 4, no_limit}) {
    CAPTURE(limit);
    const plan g = greedy_plan(t, c, limit);
    const plan b = best_plan(t, c, limit, {.max_evaluations = 2000});
    validate(t, g);
    validate(t, b);
    const sim_result rg = simulate(t, c, g), rb = simulate(t, c, b);
    CHECK(rg.peak_bytes <= limit);
    CHECK(rb.peak_bytes <= limit);
    CHECK(rb.step_s <= rg.step_s * (1 + 1e-12));
    CHECK(rb.step_s <= base.step_s * (1 + 1e-12));
    for (const plan* p : {&g, &b}) {
      const int b0 = p->bucket_of_unit[0];
      const bool alone = p->bucket_of_unit[1] != b0, all = p->num_buckets() == 1;
      CHECK((alone || all));
    }
  }
  // Without a limit, latency-bound: fewer buckets than per-unit, and faster.
  const plan loose = greedy_plan(t, c, no_limit);
  CHECK(loose.num_buckets() < 9);
  CHECK(simulate(t, c, loose).step_s < base.step_s);
}
