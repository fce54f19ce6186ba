// Activation recomputation: a unit's forward re-run inside its own backward (group.recompute(u),
// or group.forward(u) there) uses the bucket its pre_backward gathered. Training with it equals
// training without, bit for bit; recompute + backward gather each bucket once (the traffic
// formula); the measured peak stays within transient_memory_bound(); the order followed and the
// plan do not see the recompute; misuse is errc::order.
#include <doctest/doctest.h>

#include <cmath>

#include "common/catch_error.hpp"
#include "common/fake_communicator.hpp"
#include "common/mlp.hpp"

namespace {

using namespace fsdp_test;
using f32_threads = fsdp::shard_group<fsdp::buffer<float>>;
using bucketed_threads = fsdp::shard_group<fsdp::buffer<float>, fsdp::fixed_bytes>;
using f32_fake = fsdp::shard_group<fsdp::buffer<float>, fake_communicator>;

train_config config(optimizer o, recompute r) {
  train_config c;
  c.opt = o;
  c.recompute_mode = r;
  return c;
}

// Bit for bit: every parameter element and every step's loss.
void check_same(const train_result& a, const train_result& b) {
  CHECK(a.losses == b.losses);
  CHECK(a.params == b.params);
}

// What rank 0 of n (alone on a fake communicator) sees over steps 1..3 of training the test
// model with recomputation `r` (step 0 records the order).
struct observed {
  fsdp::traffic_counters traffic;
  std::size_t forward_peak = 0, backward_peak = 0, left_over = 0;
  // Transient bytes the recomputes allocated beyond what was live when each began. Allocations
  // happen on this thread (the queues only free), so this is 0 unless a recompute allocates.
  std::size_t recompute_growth = 0;
  fsdp::detail::memory_bound bound{};
  std::vector<int> forward_order, backward_order;
};

template <class Group = f32_fake>
observed observe(int n, recompute r, typename Group::options opts = {}) {
  fake_communicator comm{0, n};
  model<float> m;
  Group g{comm, {}, opts};
  m.register_with(g);
  g.finalize(per_shard_init());
  fsdp::adamw opt{g, {}};
  observed o;
  const auto& L = shapes();
  const int local = batch_global / n;
  fsdp::traffic_counters start;
  for (int step = 0; step < 4; ++step) {
    if (step == 1) start = g.traffic();
    std::vector<float> x, t, dy;
    batch_slice(step, 0, local, x, t);
    std::vector<layer_cache> caches(L.size());
    g.device().reset_peak_memory();
    for (std::size_t u = 0; u < L.size(); ++u) {
      auto s = g.forward(static_cast<int>(u));
      layer_forward(L[u], m.ptr(u, 0), m.ptr(u, 1), m.ptr(u, 2), u ? caches[u - 1].y : x, local, caches[u]);
    }
    if (step > 0) o.forward_peak = std::max(o.forward_peak, g.memory().transient_peak);
    g.device().reset_peak_memory();
    loss_and_grad(caches.back().y, t, local, dy);
    if (r != recompute::off) forget_activations(caches);
    for (std::size_t u = L.size(); u-- > 0;) {
      auto s = g.backward(static_cast<int>(u));
      if (r != recompute::off) {
        if (step > 0) o.backward_peak = std::max(o.backward_peak, g.memory().transient_peak);
        const std::size_t before = g.memory().transient_live;
        g.device().reset_peak_memory();
        recompute_layer(g, m, r, u, local, caches[u]);
        const std::size_t peak = g.memory().transient_peak;
        if (peak > before) o.recompute_growth = std::max(o.recompute_growth, peak - before);
      }
      dy = layer_backward(L[u], m.ptr(u, 0), m.ptr(u, 2), m.grad(u, 0), m.grad(u, 1), m.grad(u, 2), caches[u], dy, local);
    }
    g.finish_backward();
    if (step > 0) o.backward_peak = std::max(o.backward_peak, g.memory().transient_peak);
    opt.step();
    opt.zero_grad();
  }
  o.traffic = g.traffic() - start;
  o.left_over = g.memory().transient_live;
  o.bound = g.transient_memory_bound();
  o.forward_order.assign(g.forward_order().begin(), g.forward_order().end());
  o.backward_order.assign(g.backward_order().begin(), g.backward_order().end());
  return o;
}

// docs/design.md "Traffic": per step, gathers x P_b (S-1)/S all-gather bytes per bucket (f32,
// one bucket per unit); 3 steps.
std::uint64_t all_gather_bytes(int n, int gathers) {
  std::uint64_t sum = 0;
  for (std::size_t p : padded_units(n)) sum += static_cast<std::uint64_t>(gathers) * p * 4 * static_cast<std::uint64_t>(n - 1) / static_cast<std::uint64_t>(n);
  return 3 * sum;
}

// Runs fn as rank 0 of 1 on the test model and returns the fsdp::error it throws.
template <class F>
fsdp::error misuse(F fn) {
  return catch_error([&] {
    fake_communicator comm{0, 1};
    model<float> m;
    f32_fake g{comm};
    m.register_with(g);
    g.finalize(per_shard_init());
    fn(g);
  });
}

void check_order_error(const fsdp::error& e, int unit, const std::string& text) {
  CHECK(e.code() == fsdp::errc::order);
  CHECK(e.unit() == unit);
  CHECK_MESSAGE(std::string(e.what()).find(text) != std::string::npos, e.what());
}

}  // namespace

TEST_CASE("recompute: training with activation recomputation equals training without, bit for bit (2-4 thread ranks)") {
  for (const auto& sh : {fsdp::full_shard(), fsdp::shard_grad_op()})
    for (optimizer o : {optimizer::sgd, optimizer::adamw})
      for (int n : {2, 3, 4}) {
        CAPTURE(fsdp::to_string(sh));
        CAPTURE(static_cast<int>(o));
        CAPTURE(n);
        const auto off = train_sharded<f32_threads>(n, config(o, recompute::off), {.sharding = sh});
        check_same(train_sharded<f32_threads>(n, config(o, recompute::scope), {.sharding = sh}), off);
        check_same(train_sharded<f32_threads>(n, config(o, recompute::forward_hooks), {.sharding = sh}), off);
        CHECK(off.losses.back() < 0.9 * off.losses.front());  // it trained
      }
  // Units 0 and 1 share a bucket (600 bytes), with prefetching: the recompute of unit 0 runs on
  // the bucket unit 1's backward gathered.
  for (int n : {3, 4}) {
    CAPTURE(n);
    const bucketed_threads::options opts{.prefetch = {.forward = 2, .backward = 2}, .bucket = {.bytes = 600}};
    check_same(train_sharded<bucketed_threads>(n, config(optimizer::adamw, recompute::scope), opts),
               train_sharded<bucketed_threads>(n, config(optimizer::adamw, recompute::off), opts));
  }
}

TEST_CASE("recompute: recompute + backward gather each bucket once; the order followed and the plan do not see it") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    for (recompute r : {recompute::scope, recompute::forward_hooks}) {
      // full_shard: one forward gather + one for recompute and backward; shard_grad_op: one in all.
      const auto full = observe(n, r);
      CHECK(full.traffic.all_gather == all_gather_bytes(n, 2));
      const auto grad_op = observe(n, r, {.sharding = fsdp::shard_grad_op()});
      CHECK(grad_op.traffic.all_gather == all_gather_bytes(n, 1));
      CHECK(full.traffic == observe(n, recompute::off).traffic);
      CHECK(full.forward_order == std::vector<int>{0, 1, 2, 3});
      CHECK(full.backward_order == std::vector<int>{3, 2, 1, 0});
      CHECK(full.left_over == 0);
    }
  }
}

TEST_CASE("recompute: the measured peaks stay within transient_memory_bound(), which needs no extra term") {
  // The recompute runs inside its unit's backward position, on the bucket the bound already
  // counts there: it allocates nothing, and the bound is the one without recomputation. (The
  // peaks themselves vary by a reduction's buffers with when the reduce queue frees them.)
  for (int n : {2, 4})
    for (const auto& sh : {fsdp::full_shard(), fsdp::shard_grad_op()})
      for (int depth : {0, 1, 2}) {
        CAPTURE(n);
        CAPTURE(fsdp::to_string(sh));
        CAPTURE(depth);
        const f32_fake::options opts{.sharding = sh, .prefetch = {.forward = depth, .backward = depth}};
        const auto on = observe(n, recompute::scope, opts), off = observe(n, recompute::off, opts);
        CHECK(on.forward_peak <= on.bound.forward);
        CHECK(on.backward_peak <= on.bound.backward);
        CHECK(on.recompute_growth == 0);
        CHECK(on.bound.forward == off.bound.forward);
        CHECK(on.bound.backward == off.bound.backward);
        CHECK(on.backward_peak > 0);
      }
}

TEST_CASE("recompute: misuse is errc::order naming the unit and where it stands") {
  check_order_error(misuse([](f32_fake& g) { auto s = g.recompute(2); }), 2, "recompute during the forward pass, before the unit's forward");
  check_order_error(misuse([](f32_fake& g) {
                      auto f = g.forward(1);
                      auto s = g.recompute(1);
                    }),
                    1, "recompute while the unit is in forward");
  check_order_error(misuse([](f32_fake& g) {
                      { auto f = g.forward(1); }
                      auto s = g.recompute(1);
                    }),
                    1, "recompute before the unit's backward");
  check_order_error(misuse([](f32_fake& g) {
                      { auto f = g.forward(1); }
                      { auto b = g.backward(1); }
                      auto s = g.recompute(1);
                    }),
                    1, "recompute of a unit whose backward already ran");
  check_order_error(misuse([](f32_fake& g) {
                      { auto f = g.forward(0); }
                      auto b = g.backward(0);
                      auto s = g.recompute(0);
                      auto again = g.recompute(0);
                    }),
                    0, "recompute called twice without post_forward");
  // The hooks inside a backward: the recompute's post_forward must come before the backward's end.
  check_order_error(misuse([](f32_fake& g) {
                      { auto f = g.forward(3); }
                      g.pre_backward(3);
                      g.pre_forward(3);
                      g.post_backward(3);
                    }),
                    3, "post_backward while the unit's recompute runs (post_forward missing)");
  check_order_error(misuse([](f32_fake& g) {
                      { auto f = g.forward(3); }
                      g.pre_backward(3);
                      g.pre_forward(3);
                      g.pre_forward(3);
                    }),
                    3, "pre_forward called twice without post_forward");
  check_order_error(misuse([](f32_fake& g) {
                      for (int u = 0; u < 4; ++u) auto f = g.forward(u);
                      g.pre_backward(3);
                      g.pre_forward(3);
                      g.finish_backward();
                    }),
                    3, "finish_backward while the unit is still between its pre and post hooks");
  // A refused recompute changes nothing: the pass goes on.
  fake_communicator comm{0, 1};
  model<float> m;
  f32_fake g{comm};
  m.register_with(g);
  g.finalize(per_shard_init());
  for (int u = 0; u < 4; ++u) auto f = g.forward(u);
  CHECK_THROWS_AS((void)g.recompute(2), fsdp::error);
  for (int u = 3; u >= 0; --u) {
    auto b = g.backward(u);
    auto s = g.recompute(u);
  }
  CHECK_NOTHROW(g.finish_backward());
}
