// The simulator against timelines and byte counts worked out by hand, and against shard_group
// itself: the same bucket layouts, the same bytes per collective kind as the traffic counters
// show, the same forward peak and persistent bytes as the device's memory counters.
//
// Hand-computed cases use 3 units of 1024 f32 elements on a shard group of 2 (padded to 1024,
// shard 512): an all-gather or reduce-scatter sends 512 * 4 * (2 - 1) = 2048 bytes. With
// beta = 2048 B/s and alpha_ag = 1 s, alpha_rs = 0.5 s, an all-gather takes 2 s and a
// reduce-scatter 1.5 s; each unit computes 3 s forward and 4 s backward.
//
// Nested units: a GPT-shaped trace (unit 0 in use around the others) worked out by hand, and
// against shard_group running the same nested hooks.

#include "fsdp/schedule/simulator.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/mlp.hpp"
#include "fsdp/comm/concepts.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/fsdp.hpp"
#include "schedule/common.hpp"

namespace {

using namespace fsdp::schedule;
using sched_test::equal_units;
using sched_test::nested_units;

cost_model hand_costs(double rs_alpha = 0.5) {
  cost_model c;
  c.all_gather = {1.0, 2048.0};
  c.reduce_scatter = {rs_alpha, 2048.0};
  c.all_reduce = {0.0, 1e30};
  return c;
}

step_trace three_units() { return equal_units(3, 1024, 3.0, 4.0, 2, 2); }

// The collective of `kind` for `bucket` in `phase` (the test fails when there is none).
collective_record find(const sim_result& r, collective_kind kind, int bucket, step_phase phase) {
  for (const auto& c : r.collectives)
    if (c.kind == kind && c.bucket == bucket && c.phase == phase) return c;
  FAIL("no " << to_string(kind) << " of bucket " << bucket << " in " << to_string(phase));
  return {};
}

}  // namespace

TEST_CASE("simulate: no prefetch, every all-gather is exposed and the link serializes a reduce-scatter and an all-gather") {
  const step_trace t = three_units();
  const sim_result r = simulate(t, hand_costs(), per_unit_prefetch(t, 0, 0));
  // Forward: gather 2 s then compute 3 s, three times.
  CHECK(r.forward_s == doctest::Approx(15.0));
  // Backward: AG2 15-17, compute 17-21; RS2 (issued 21, first) 21-22.5 holds the link, so AG1
  // (issued 21) runs 22.5-24.5; compute 24.5-28.5; RS1 28.5-30; AG0 30-32 behind it; compute
  // 32-36; RS0 36-37.5; finish_backward waits for it.
  CHECK(r.step_s == doctest::Approx(37.5));
  CHECK(r.backward_s == doctest::Approx(22.5));
  CHECK(r.compute_s == doctest::Approx(21.0));
  CHECK(r.exposed_comm_s == doctest::Approx(16.5));
  CHECK(r.comm_busy_s == doctest::Approx(6 * 2.0 + 3 * 1.5));
  const auto ag1 = find(r, collective_kind::all_gather, 1, step_phase::backward);
  CHECK(ag1.issue_s == doctest::Approx(21.0));
  CHECK(ag1.start_s == doctest::Approx(22.5));  // waited for the link, not for its queue
  CHECK(ag1.end_s == doctest::Approx(24.5));
  const auto rs2 = find(r, collective_kind::reduce_scatter, 2, step_phase::backward);
  CHECK(rs2.start_s == doctest::Approx(21.0));
  CHECK(rs2.bytes == 2048);
  CHECK(r.collectives.size() == 9);
}

TEST_CASE("simulate: prefetch 1 hides the all-gathers behind the previous bucket's compute") {
  const step_trace t = three_units();
  const sim_result r = simulate(t, hand_costs(), per_unit_prefetch(t, 1, 1));
  // Forward: AG0 0-2 exposed; AG1 2-4 under compute 2-5; AG2 5-7 under compute 5-8; 8-11.
  CHECK(r.forward_s == doctest::Approx(11.0));
  // Backward: AG2 on demand 11-13, AG1 13-15 under compute 13-17; RS2 17-18.5 then AG0
  // 18.5-20.5 under compute 17-21; RS1 21-22.5 under compute 21-25; RS0 25-26.5 exposed.
  CHECK(r.step_s == doctest::Approx(26.5));
  CHECK(r.exposed_comm_s == doctest::Approx(5.5));
  const auto ag0 = find(r, collective_kind::all_gather, 0, step_phase::backward);
  CHECK(ag0.issue_s == doctest::Approx(17.0));
  CHECK(ag0.start_s == doctest::Approx(18.5));
  // Faster than without prefetch, with the same bytes on the link.
  const sim_result none = simulate(t, hand_costs(), per_unit_prefetch(t, 0, 0));
  CHECK(r.step_s < none.step_s);
  CHECK(r.comm_busy_s == doctest::Approx(none.comm_busy_s));
}

TEST_CASE("simulate: with one reduction in flight the compute thread blocks until the previous one ends") {
  const step_trace t = three_units();
  // A 6.5 s reduce-scatter, longer than a unit's 4 s backward.
  const sim_result r = simulate(t, hand_costs(5.5), per_unit_prefetch(t, 1, 1));
  // RS2 17-23.5; AG0 (issued 17) waits for the link until 23.5-25.5. Bucket 1's backward ends
  // at 21 and blocks until RS2 ends at 23.5: RS1 is issued then and starts after AG0, 25.5-32.
  const auto rs1 = find(r, collective_kind::reduce_scatter, 1, step_phase::backward);
  CHECK(rs1.issue_s == doctest::Approx(23.5));
  CHECK(rs1.start_s == doctest::Approx(25.5));
  CHECK(rs1.end_s == doctest::Approx(32.0));
  // Bucket 0 computes 25.5-29.5, then waits for RS1 (32) before issuing RS0: 32-38.5.
  const auto rs0 = find(r, collective_kind::reduce_scatter, 0, step_phase::backward);
  CHECK(rs0.issue_s == doctest::Approx(32.0));
  CHECK(r.step_s == doctest::Approx(38.5));

  // Letting every reduction run until finish_backward unblocks the compute thread: RS1 is
  // issued at 21 (and still starts at 25.5, behind AG0 on the link).
  plan relaxed = per_unit_prefetch(t, 1, 1);
  std::fill(relaxed.reduce_wait.begin(), relaxed.reduce_wait.end(), 3);
  const sim_result q = simulate(t, hand_costs(5.5), relaxed);
  CHECK(find(q, collective_kind::reduce_scatter, 1, step_phase::backward).issue_s == doctest::Approx(21.0));
  CHECK(find(q, collective_kind::reduce_scatter, 0, step_phase::backward).issue_s == doctest::Approx(29.5));
}

TEST_CASE("simulate: peak memory equals the padded bytes worked out by hand") {
  const step_trace t = three_units();  // f32: gathered and gradient buffers 4096 B, output shard 2048 B
  const sim_result r = simulate(t, hand_costs(), per_unit_prefetch(t, 1, 1));
  CHECK(r.persistent_bytes == 3 * 512 * 4 * (2 + 2));  // master, grad shard, AdamW's two moments
  CHECK(r.forward_peak_transient_bytes == 2 * 4096);     // the bucket in use and the prefetched one
  // Backward, at bucket 1's pre-hook (t = 17): gathered 1 and 0, gradients 2 and 1, and RS2's
  // output shard (its input is bucket 2's gradient buffer).
  CHECK(r.backward_peak_transient_bytes == 2 * 4096 + 2 * 4096 + 2048);
  CHECK(r.peak_transient_bytes == 18432);
  CHECK(r.peak_bytes == r.persistent_bytes + 18432);
  // A kept copy of each shard in a 2-byte gathered dtype (keep_low_precision_shard).
  step_trace kept = t;
  kept.param_elem = 2;
  kept.low_precision_shard = true;
  CHECK(simulate(kept, hand_costs(), per_unit_prefetch(kept, 1, 1)).persistent_bytes == 3 * 512 * (4 * (2 + 2) + 2));

  // Without prefetch: one gathered bucket at a time in forward.
  CHECK(simulate(t, hand_costs(), per_unit_prefetch(t, 0, 0)).forward_peak_transient_bytes == 4096);

  // grad_op keeps every bucket gathered from its forward to the end of its backward.
  step_trace z2 = t;
  z2.reshard_after_forward = false;
  const sim_result g = simulate(z2, hand_costs(), per_unit_prefetch(z2, 1, 1));
  CHECK(g.forward_peak_transient_bytes == 3 * 4096);
  CHECK(g.collectives.size() == 6);  // 3 all-gathers, 3 reduce-scatters
}

TEST_CASE("simulate: bf16 params with f32 reduction release the gradient when the cast runs") {
  step_trace t = three_units();
  t.param_elem = 2;  // gathered and gradient buffers 2048 B; reduce-dtype copy 4096 B; output shard 2048 B
  cost_model c = hand_costs();
  c.all_gather = {1.0, 1024.0};  // 1024 bytes sent: still 2 s
  const sim_result r = simulate(t, c, per_unit_prefetch(t, 1, 1));
  CHECK(r.forward_peak_transient_bytes == 2 * 2048);
  // At bucket 1's pre-hook (t = 17): RS2 is running (its gradient was cast and released at
  // its issue; the f32 copy and the output shard are live), gathered 1 and 0, gradient 1.
  // That beats the moment of RS2's issue: gathered 1, gradient 2, copy, output.
  CHECK(r.backward_peak_transient_bytes == 2 * 2048 + 2048 + 4096 + 2048);
  CHECK(r.collectives.size() == 9);
}

TEST_CASE("simulate: bytes per collective follow traffic_counters for hybrid and no_shard") {
  using fsdp::dtype;
  // Hybrid: 2 replicas of a shard group of 2 (world 4): padded to lcm(4, 128) = 128 multiples.
  step_trace h = equal_units(2, 1000, 1, 1, 4, 2);
  const cost_model free_links{{0, 1e30}, {0, 1e30}, {0, 1e30}};
  const sim_result r = simulate(h, free_links, per_unit_prefetch(h));
  const std::size_t shard = 512;  // 1000 elements padded to 1024, over 2 shards
  fsdp::traffic_counters expect;
  for (int b = 0; b < 2; ++b) {
    expect.add_all_gather(shard, dtype::f32, 2);  // forward
    expect.add_all_gather(shard, dtype::f32, 2);  // backward (resharded after forward)
    expect.add_reduce_scatter(shard, dtype::f32, 2);
    expect.add_all_reduce(shard, dtype::f32, 2);
  }
  fsdp::traffic_counters got;
  for (const auto& c : r.collectives) {
    auto& counter = c.kind == collective_kind::all_gather ? got.all_gather
                    : c.kind == collective_kind::reduce_scatter ? got.reduce_scatter
                                                                : got.all_reduce;
    counter += c.bytes;
  }
  CHECK(got.all_gather == expect.all_gather);
  CHECK(got.reduce_scatter == expect.reduce_scatter);
  CHECK(got.all_reduce == expect.all_reduce);
  CHECK(r.persistent_bytes == 2 * shard * 4 * 4);

  // no_shard (S = 1) in f32: the handles alias the master copy, no gathered buffer, no
  // all-gather; only the all-reduce of the whole buffer over 4 replicas.
  step_trace d = equal_units(2, 1000, 1, 1, 4, 1);
  const sim_result q = simulate(d, free_links, per_unit_prefetch(d));
  for (const auto& c : q.collectives) CHECK(c.kind == collective_kind::all_reduce);
  CHECK(q.collectives.size() == 2);
  fsdp::traffic_counters ar;
  ar.add_all_reduce(1024, dtype::f32, 4);
  CHECK(q.collectives[0].bytes == ar.all_reduce);
  CHECK(q.forward_peak_transient_bytes == 0);
}

namespace {

// What a real shard_group did in its second step (the first records the order), on rank 0.
struct measured_group {
  fsdp::traffic_counters traffic;
  std::size_t forward_peak = 0, persistent = 0;
  std::vector<fsdp::flat_layout> layouts;
  std::vector<int> forward_order, backward_order;
};

// Trains the parity model 2 steps on n thread ranks, one bucket per unit, prefetch 1. With
// nest_unit0, unit 0 stays in use around the others in both passes, as GPT's embedding does.
measured_group run_group(int n, fsdp::sharding sharding, bool nest_unit0) {
  using namespace fsdp_test;
  std::vector<measured_group> per(static_cast<std::size_t>(n));
  fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
    using group_t = fsdp::shard_group<fsdp::buffer<float>>;
    model<float> m;
    group_t g{comm, {}, {.sharding = sharding, .prefetch = {.forward = 1, .backward = 1}}};
    m.register_with(g);
    g.finalize(per_shard_init());
    fsdp::adamw opt{g, {}};
    auto& me = per[static_cast<std::size_t>(comm.rank())];
    const auto& L = shapes();
    const int local = batch_global / n;
    const std::size_t first = nest_unit0 ? 1 : 0;  // the units with their own scopes
    for (int step = 0; step < 2; ++step) {  // step 0 records the order; step 1 prefetches
      const fsdp::traffic_counters before = g.traffic();
      std::vector<float> x, tg, dy;
      batch_slice(step, comm.rank() * local, local, x, tg);
      std::vector<layer_cache> caches(L.size());
      g.device().reset_peak_memory();
      if (nest_unit0) {
        g.pre_forward(0);
        layer_forward(L[0], m.ptr(0, 0), m.ptr(0, 1), m.ptr(0, 2), x, local, caches[0]);
      }
      for (std::size_t u = first; u < L.size(); ++u) {
        auto s = g.forward(static_cast<int>(u));
        layer_forward(L[u], m.ptr(u, 0), m.ptr(u, 1), m.ptr(u, 2), u ? caches[u - 1].y : x, local, caches[u]);
      }
      if (nest_unit0) g.post_forward(0);
      me.forward_peak = g.memory().transient_peak;
      loss_and_grad(caches.back().y, tg, local, dy);
      if (nest_unit0) g.pre_backward(0);
      for (std::size_t u = L.size(); u-- > first;) {
        auto s = g.backward(static_cast<int>(u));
        dy = layer_backward(L[u], m.ptr(u, 0), m.ptr(u, 2), m.grad(u, 0), m.grad(u, 1), m.grad(u, 2), caches[u], dy, local);
      }
      if (nest_unit0) {
        dy = layer_backward(L[0], m.ptr(0, 0), m.ptr(0, 2), m.grad(0, 0), m.grad(0, 1), m.grad(0, 2), caches[0], dy, local);
        g.post_backward(0);
      }
      g.finish_backward();
      opt.step();
      opt.zero_grad();
      me.traffic = g.traffic() - before;
    }
    me.persistent = g.memory().persistent_live;
    for (std::size_t b = 0; b < g.num_buckets(); ++b) me.layouts.push_back(g.layout(b));
    me.forward_order.assign(g.forward_order().begin(), g.forward_order().end());
    me.backward_order.assign(g.backward_order().begin(), g.backward_order().end());
  });
  return per[0];
}

}  // namespace

TEST_CASE("simulate: shard_group's layouts, per-step traffic, forward peak and persistent bytes") {
  using namespace fsdp_test;
  auto trace_for = [](int n, int s) {
    step_trace t;
    for (const auto& l : shapes()) t.units.push_back({"", param_sizes(l), 1e-3, 2e-3});
    use_registration_order(t);
    t.world_size = n;
    t.shard_size = s;
    return t;
  };
  for (auto [n, s] : {std::pair{4, 4}, std::pair{3, 3}, std::pair{4, 2}}) {
    CAPTURE(n);
    CAPTURE(s);
    const measured_group got = run_group(n, fsdp::hybrid_shard(s), false);
    const step_trace t = trace_for(n, s);
    const plan p = per_unit_prefetch(t, 1, 1);
    const auto layouts = bucket_layouts(t, p.bucket_of_unit);
    REQUIRE(layouts.size() == got.layouts.size());
    for (std::size_t b = 0; b < layouts.size(); ++b) {
      CHECK(layouts[b].padded_numel() == got.layouts[b].padded_numel());
      CHECK(layouts[b].shard_numel() == got.layouts[b].shard_numel());
      CHECK(std::equal(layouts[b].entries().begin(), layouts[b].entries().end(), got.layouts[b].entries().begin(),
                       got.layouts[b].entries().end()));
    }
    const sim_result r = simulate(t, h100_infiniband(s, n / s), p);
    std::uint64_t ag = 0, rs = 0, ar = 0;
    for (const auto& c : r.collectives)
      (c.kind == collective_kind::all_gather ? ag : c.kind == collective_kind::reduce_scatter ? rs : ar) += c.bytes;
    CHECK(ag == got.traffic.all_gather);
    CHECK(rs == got.traffic.reduce_scatter);
    CHECK(ar == got.traffic.all_reduce);
    // The forward allocates and frees on the compute thread only, so its peak is exact.
    CHECK(r.forward_peak_transient_bytes == got.forward_peak);
    CHECK(r.persistent_bytes == got.persistent);
  }
}

TEST_CASE("simulate: a GPT-shaped trace, unit 0 in use around units 1..3, worked out by hand") {
  // 4 units of 1024 f32 (gathered 4096 B, output shard 2048 B); all-gather 2 s, reduce-scatter
  // 1.5 s. Forward: pre 0, embedding 1 s, blocks 3 s each, head 2 s, post 0. Backward: loss
  // 0.5 s, pre 0, head backward 2 s, blocks 3, 2, 1 at 4 s each, embedding backward 1 s,
  // post 0, then 0.25 s to finish_backward; optimizer 1 s. FSDP2's plan: bucket 0 is at
  // position 0 in both passes; backward positions 0, 3, 2, 1 for buckets 0, 1, 2, 3.
  step_trace t = nested_units(3, 1024, 2, 2);
  t.backward_tail_s = 0.25;
  t.optimizer_s = 1;
  const plan p = per_unit_prefetch(t, 1, 1);
  CHECK(p.backward_issue == std::vector<int>{0, 2, 1, 0});
  CHECK(p.reduce_wait == std::vector<int>{1, 4, 3, 2});
  const sim_result r = simulate(t, hand_costs(), p);

  // Forward: AG0 0-2 exposed, AG1 (prefetched at pre 0) 2-4; the embedding runs 2-3, then
  // pre 1 waits for AG1 until 4 and prefetches AG2 4-6; block 1 4-7; pre 2 prefetches AG3
  // 7-9; block 2 7-10, block 3 10-13, head 13-15, post 0 at 15.
  CHECK(r.forward_s == doctest::Approx(15.0));
  CHECK(find(r, collective_kind::all_gather, 1, step_phase::forward).end_s == doctest::Approx(4.0));
  CHECK(find(r, collective_kind::all_gather, 3, step_phase::forward).start_s == doctest::Approx(7.0));
  // Backward: the loss 15-15.5; pre 0 gathers bucket 0 again (AG0 15.5-17.5, exposed) and
  // prefetches AG3 17.5-19.5; head backward 17.5-19.5; pre 3 prefetches AG2 19.5-21.5; block 3
  // 19.5-23.5, then RS3 23.5-25 and, at pre 2, AG1 behind it 25-27; block 2 23.5-27.5, RS2
  // 27.5-29; block 1 27.5-31.5, RS1 31.5-33; the embedding's backward 31.5-32.5, and only at
  // post 0 is bucket 0's reduction issued: RS0 waits for RS1's link until 33, ends 34.5. The
  // tail ends at 32.75; finish_backward waits until 34.5.
  const auto ag0 = find(r, collective_kind::all_gather, 0, step_phase::backward);
  CHECK(ag0.issue_s == doctest::Approx(15.5));
  CHECK(ag0.end_s == doctest::Approx(17.5));
  const auto ag1 = find(r, collective_kind::all_gather, 1, step_phase::backward);
  CHECK(ag1.issue_s == doctest::Approx(23.5));
  CHECK(ag1.start_s == doctest::Approx(25.0));
  const auto rs0 = find(r, collective_kind::reduce_scatter, 0, step_phase::backward);
  CHECK(rs0.issue_s == doctest::Approx(32.5));
  CHECK(rs0.start_s == doctest::Approx(33.0));
  CHECK(rs0.end_s == doctest::Approx(34.5));
  CHECK(find(r, collective_kind::reduce_scatter, 1, step_phase::backward).end_s == doctest::Approx(33.0));
  CHECK(r.backward_s == doctest::Approx(19.5));
  CHECK(r.optimizer_s == doctest::Approx(1.0));
  CHECK(r.step_s == doctest::Approx(35.5));
  CHECK(r.compute_s == doctest::Approx(12.0 + 15.75 + 1.0));
  // Exposed: AG0 2 s and 1 s of AG1 in forward, AG0 2 s in backward, RS0's last 1.75 s.
  CHECK(r.exposed_comm_s == doctest::Approx(6.75));
  CHECK(r.collectives.size() == 12);

  // Memory: bucket 0 is held for the whole of each pass. Forward, from t = 4: buckets 0, 1 and
  // the prefetched 2. Backward, at 23.5 (RS3 issued, pre 2): gathered 0, 2 and 1, gradients 0,
  // 3 (being reduced) and 2, RS3's output shard.
  CHECK(r.persistent_bytes == 4 * 512 * 4 * (2 + 2));
  CHECK(r.forward_peak_transient_bytes == 3 * 4096);
  CHECK(r.backward_peak_transient_bytes == 3 * 4096 + 3 * 4096 + 2048);
  CHECK(r.peak_bytes == r.persistent_bytes + 26624);

  // The same units and orders without events (one after another, as derived) miss that: two
  // buckets gathered at a time in forward.
  step_trace flat = t;
  flat.forward_events.clear();
  flat.backward_events.clear();
  const sim_result f = simulate(flat, hand_costs(), p);
  CHECK(f.forward_peak_transient_bytes == 2 * 4096);
  CHECK(f.peak_bytes < r.peak_bytes);
  CHECK(f.compute_s == doctest::Approx(r.compute_s - 0.5));  // the loss is not a unit's

  // Blocks 1..3 in one bucket (3072 elements: all-gather 1 + 6144 / 2048 = 4 s, reduce-scatter
  // 3.5 s), prefetch 1. The bucket is freed and reduced at the post of its last unit, not of
  // its first. Forward: AG0 0-2, AG1 2-6; embedding 2-3, pre 1 waits until 6, blocks 6-15,
  // head 15-17. Backward: loss 17-17.5, AG0 17.5-19.5, AG1 19.5-23.5 (prefetched at pre 0),
  // head backward 19.5-21.5, pre 3 waits until 23.5, blocks 23.5-35.5; at post 1 RS1
  // 35.5-39; embedding backward 35.5-36.5; RS0 issued 36.5 runs 39-40.5; optimizer 40.5-41.5.
  const plan blocks = from_policies(t, {0, 1, 1, 1}, 1, 1);
  const sim_result b = simulate(t, hand_costs(), blocks);
  CHECK(b.forward_s == doctest::Approx(17.0));
  const auto rs1 = find(b, collective_kind::reduce_scatter, 1, step_phase::backward);
  CHECK(rs1.issue_s == doctest::Approx(35.5));
  CHECK(rs1.end_s == doctest::Approx(39.0));
  CHECK(find(b, collective_kind::reduce_scatter, 0, step_phase::backward).start_s == doctest::Approx(39.0));
  CHECK(b.step_s == doctest::Approx(41.5));
  CHECK(b.forward_peak_transient_bytes == 4096 + 3 * 4096);
  // From 23.5: gathered 0 and 1, gradients 0 and 1.
  CHECK(b.backward_peak_transient_bytes == 2 * (4096 + 3 * 4096));
}

TEST_CASE("simulate: a nested unit 0 as shard_group runs it: the same forward peak, traffic and orders") {
  using namespace fsdp_test;
  for (auto [n, s] : {std::pair{4, 4}, std::pair{3, 3}, std::pair{4, 2}}) {
    CAPTURE(n);
    CAPTURE(s);
    const measured_group got = run_group(n, fsdp::hybrid_shard(s), true);
    step_trace t = nested_units(3, 1, n, s);
    for (std::size_t u = 0; u < shapes().size(); ++u) t.units[u].param_numels = param_sizes(shapes()[u]);
    CHECK(got.forward_order == t.forward_order);
    CHECK(got.backward_order == t.backward_order);
    const sim_result r = simulate(t, h100_infiniband(s, n / s), per_unit_prefetch(t, 1, 1));
    std::uint64_t ag = 0, rs = 0, ar = 0;
    for (const auto& c : r.collectives)
      (c.kind == collective_kind::all_gather ? ag : c.kind == collective_kind::reduce_scatter ? rs : ar) += c.bytes;
    CHECK(ag == got.traffic.all_gather);
    CHECK(rs == got.traffic.reduce_scatter);
    CHECK(ar == got.traffic.all_reduce);
    // Bucket 0 stays gathered through the forward, next to the block in use and the prefetched
    // one: more than without events, and exactly what the group allocated.
    CHECK(r.forward_peak_transient_bytes == got.forward_peak);
    step_trace flat = t;
    flat.forward_events.clear();
    CHECK(simulate(flat, h100_infiniband(s, n / s), per_unit_prefetch(t, 1, 1)).forward_peak_transient_bytes < got.forward_peak);
    CHECK(r.persistent_bytes == got.persistent);
  }
}
