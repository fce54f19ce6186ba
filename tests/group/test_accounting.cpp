// Traffic and memory accounting: per-rank byte counters equal the DESIGN.md formulas exactly,
// and per-rank peak memory stays within the documented bounds. A rank's traffic and memory do
// not depend on its peers' values, so each rank runs alone on a fake_communicator.
#include <doctest/doctest.h>

#include <numeric>

#include "common/fake_communicator.hpp"
#include "common/mlp.hpp"

namespace {

using namespace fsdp_test;
template <class T, class... Policies>
using fake_group = fsdp::shard_group<fsdp::buffer<T>, Policies..., fake_communicator>;

// Rank r of n alone, on hosts of `ranks_per_host` ranks (0: one host), with the splits of
// sharding `s` planned as shard_group lays out HSDP: shard groups of S consecutive ranks, then
// replica groups of one rank of each.
fake_communicator fake_rank(int r, int n, const fsdp::sharding& s, int ranks_per_host = 0) {
  fake_communicator comm{r, n, hosts_in_runs(n, ranks_per_host)};
  const int shard = s.shard_group_size(n, fsdp::topology_of(comm).ranks_per_host());
  if (shard > 1 && shard < n && n % shard == 0) {
    std::vector<int> by_shard, by_replica;
    for (int q = 0; q < n; ++q) by_shard.push_back(q / shard), by_replica.push_back(q % shard);
    comm.plan_split(by_shard);
    comm.plan_split(by_replica);
  }
  return comm;
}

struct measured {
  fsdp::traffic_counters traffic;  // over steps 2..4 (the first step also checks unit order)
  std::size_t forward_peak = 0;    // transient bytes, steady-state forward
  std::size_t backward_peak = 0;   // transient bytes, steady-state backward
  std::size_t persistent = 0;      // sharded state after the optimizer allocated its moments
  std::size_t left_over = 0;       // transient bytes still allocated after the last step
};

// Trains 4 steps as each of `n` ranks; returns rank 0's figures (and checks all ranks agree on traffic).
template <class Group>
measured measure(int n, typename Group::options opts, int ranks_per_host = 0) {
  std::vector<measured> per(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    fake_communicator comm = fake_rank(r, n, opts.sharding, ranks_per_host);
    using T = typename Group::param_type;
    model<T> m;
    Group g{comm, {}, opts};
    m.register_with(g);
    g.finalize(per_shard_init());
    fsdp::adamw opt{g, {}};
    train_config cfg;
    auto& me = per[static_cast<std::size_t>(comm.rank())];
    const auto& L = shapes();
    const int local = batch_global / n;
    fsdp::traffic_counters start;
    for (int step = 0; step < 4; ++step) {
      if (step == 1) start = g.traffic();
      std::vector<float> x, t, dy;
      batch_slice(step, comm.rank() * local, local, x, t);
      std::vector<layer_cache> caches(L.size());
      g.device().reset_peak_memory();
      for (std::size_t u = 0; u < L.size(); ++u) {
        auto s = g.forward(static_cast<int>(u));
        layer_forward(L[u], m.ptr(u, 0), m.ptr(u, 1), m.ptr(u, 2), u ? caches[u - 1].y : x, local, caches[u]);
      }
      if (step > 0) me.forward_peak = std::max(me.forward_peak, g.memory().transient_peak);
      g.device().reset_peak_memory();
      loss_and_grad(caches.back().y, t, local, dy);
      for (std::size_t u = L.size(); u-- > 0;) {
        auto s = g.backward(static_cast<int>(u));
        dy = layer_backward(L[u], m.ptr(u, 0), m.ptr(u, 2), m.grad(u, 0), m.grad(u, 1), m.grad(u, 2), caches[u], dy, local);
      }
      g.finish_backward();
      if (step > 0) me.backward_peak = std::max(me.backward_peak, g.memory().transient_peak);
      opt.step();
      opt.zero_grad();
    }
    me.traffic = g.traffic() - start;
    me.persistent = g.memory().persistent_live;
    me.left_over = g.memory().transient_live;
  }
  for (const auto& p : per) {
    CHECK(p.traffic == per[0].traffic);
    CHECK(p.left_over == 0);  // nothing gathered or unreduced is left over
  }
  return per[0];
}

struct expected_traffic {
  std::uint64_t all_gather, reduce_scatter, all_reduce;
};

// The DESIGN.md formulas, per step, summed over buckets with P_b = padded bytes:
//   all-gather  gathers x P_b(param) (S-1)/S       (gathers = 2 with reshard, 1 without)
//   reduce-scatter       P_b(reduce) (S-1)/S
//   all-reduce (R > 1)   2 (P_b(reduce)/S) (R-1)/R
expected_traffic formula(int n, int s, int gathers, std::size_t param_bytes, std::size_t reduce_bytes, int steps) {
  const int r = n / s;
  expected_traffic e{0, 0, 0};
  for (std::size_t p : padded_units(n)) {
    e.all_gather += static_cast<std::uint64_t>(gathers) * p * param_bytes * static_cast<std::uint64_t>(s - 1) / static_cast<std::uint64_t>(s);
    e.reduce_scatter += p * reduce_bytes * static_cast<std::uint64_t>(s - 1) / static_cast<std::uint64_t>(s);
    e.all_reduce += 2 * (p / static_cast<std::size_t>(s)) * reduce_bytes * static_cast<std::uint64_t>(r - 1) / static_cast<std::uint64_t>(r);
  }
  e.all_gather *= static_cast<std::uint64_t>(steps);
  e.reduce_scatter *= static_cast<std::uint64_t>(steps);
  e.all_reduce *= static_cast<std::uint64_t>(steps);
  return e;
}

void check_traffic(const fsdp::traffic_counters& t, const expected_traffic& e) {
  CHECK(t.all_gather == e.all_gather);
  CHECK(t.reduce_scatter == e.reduce_scatter);
  CHECK(t.all_reduce == e.all_reduce);
  CHECK(t.broadcast == 0);
}

std::size_t total_padded(int n) {
  const auto v = padded_units(n);
  return std::accumulate(v.begin(), v.end(), std::size_t{0});
}

}  // namespace

TEST_CASE("traffic: per-rank bytes equal the formulas for every strategy (f32)") {
  using full = fake_group<float>;
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    const auto t = measure<full>(n, {}).traffic;
    check_traffic(t, formula(n, n, 2, 4, 4, 3));
    // DESIGN.md: full shard moves 3 P (N-1)/N per rank per step.
    CHECK(t.total() == 3 * 3 * total_padded(n) * 4 * static_cast<std::size_t>(n - 1) / static_cast<std::size_t>(n));
    const auto g = measure<full>(n, {.sharding = fsdp::shard_grad_op()}).traffic;
    check_traffic(g, formula(n, n, 1, 4, 4, 3));
    CHECK(g.total() == 3 * 2 * total_padded(n) * 4 * static_cast<std::size_t>(n - 1) / static_cast<std::size_t>(n));
    const auto d = measure<full>(n, {.sharding = fsdp::no_shard()}).traffic;
    check_traffic(d, formula(n, 1, 0, 4, 4, 3));
    CHECK(d.total() == 3 * 2 * total_padded(n) * 4 * static_cast<std::size_t>(n - 1) / static_cast<std::size_t>(n));
  }
  check_traffic(measure<full>(4, {.sharding = fsdp::hybrid_shard(2)}).traffic, formula(4, 2, 2, 4, 4, 3));
  check_traffic(measure<full>(8, {.sharding = fsdp::hybrid_shard(4)}).traffic, formula(8, 4, 2, 4, 4, 3));
}

TEST_CASE("traffic: the inter-host bytes are the share of peers on other hosts; hybrid per host sends only its all-reduce across") {
  using full = fake_group<float>;
  const int two_per_host = 2;
  SUBCASE("one host: nothing crosses") {
    CHECK(measure<full>(4, {}).traffic.inter_host == 0);
  }
  SUBCASE("hybrid_shard_per_host: shard groups inside hosts, the replica all-reduce between them") {
    const auto t = measure<full>(4, {.sharding = fsdp::hybrid_shard_per_host()}, two_per_host).traffic;
    check_traffic(t, formula(4, 2, 2, 4, 4, 3));
    CHECK(t.inter_host == t.all_reduce);
    CHECK(t.inter_host > 0);
    const auto t8 = measure<full>(8, {.sharding = fsdp::hybrid_shard_per_host()}, 4).traffic;
    check_traffic(t8, formula(8, 4, 2, 4, 4, 3));
    CHECK(t8.inter_host == t8.all_reduce);
  }
  SUBCASE("full and no shard over 2 hosts of 2: two of each rank's three peers are remote") {
    for (auto s : {fsdp::full_shard(), fsdp::no_shard()}) {
      CAPTURE(fsdp::to_string(s));
      const auto t = measure<full>(4, {.sharding = s}, two_per_host).traffic;
      CHECK(t.total() % 3 == 0);
      CHECK(t.inter_host == t.total() / 3 * 2);
    }
  }
  SUBCASE("shard groups across hosts (hybrid_shard(2) with one rank per host): all of it crosses") {
    const auto t = measure<full>(4, {.sharding = fsdp::hybrid_shard(2)}, 1).traffic;
    CHECK(t.inter_host == t.total());
  }
}

TEST_CASE("hybrid_shard_per_host: hosts with different numbers of ranks are refused, naming the layout") {
  std::string what;
  try {
    fake_communicator comm = fake_rank(0, 4, fsdp::hybrid_shard_per_host(), 3);
    fake_group<float> g{comm, {}, {.sharding = fsdp::hybrid_shard_per_host()}};
    model<float> m;
    m.register_with(g);
    g.finalize(per_shard_init());
  } catch (const fsdp::error& e) {
    what = e.what();
    CHECK(e.code() == fsdp::errc::invalid_argument);
  }
  CHECK(what.find("hybrid_shard_per_host(): a shard group per host needs as many ranks on every host") != std::string::npos);
  CHECK(what.find("2 hosts: [0 0 0 1]") != std::string::npos);
}

TEST_CASE("traffic and memory: HSDP accumulation all-reduces once per step and holds one shard per bucket meanwhile") {
  using full = fake_group<float>;
  constexpr int n = 4, s = 2, micro = 3, steps = 3;
  const std::size_t held_bytes = total_padded(n) / s * sizeof(float);  // a reduce-dtype shard per bucket
  for (bool last_only : {false, true}) {
    CAPTURE(last_only);
    std::vector<fsdp::traffic_counters> traffic(n);
    std::vector<std::size_t> held(n), left(n);
    for (int rank = 0; rank < n; ++rank) {
      fake_communicator comm = fake_rank(rank, n, fsdp::hybrid_shard(s));
      model<float> m;
      full g{comm, {}, {.sharding = fsdp::hybrid_shard(s)}};
      m.register_with(g);
      g.finalize(per_shard_init());
      fsdp::sgd opt{g, {}};
      const auto r = static_cast<std::size_t>(comm.rank());
      fsdp::traffic_counters start;
      for (int step = 0; step <= steps; ++step) {
        if (step == 1) start = g.traffic();
        const std::size_t before = g.memory().persistent_live;
        for (int k = 0; k < micro; ++k) {
          g.set_requires_all_reduce(!last_only || k + 1 == micro);
          sharded_step(g, m, train_config{}, step);  // one micro-batch, reduced (sync on)
          if (k == 0) held[r] = g.memory().persistent_live - before;
        }
        opt.step();
        opt.zero_grad();
        left[r] = g.memory().persistent_live - before;
      }
      traffic[r] = g.traffic() - start;
    }
    const auto per_pass = formula(n, s, 2, 4, 4, steps);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto& t = traffic[static_cast<std::size_t>(r)];
      CHECK(t.all_gather == micro * per_pass.all_gather);
      CHECK(t.reduce_scatter == micro * per_pass.reduce_scatter);
      CHECK(t.all_reduce == (last_only ? 1 : micro) * per_pass.all_reduce);
      CHECK(held[static_cast<std::size_t>(r)] == (last_only ? held_bytes : 0));
      CHECK(left[static_cast<std::size_t>(r)] == 0);  // the held sums are freed by the all-reduce
    }
  }
}

TEST_CASE("traffic: mixed precision gathers in the param dtype and reduces in the reduce dtype") {
  using bf16_f32 = fake_group<fsdp::bf16, fsdp::mixed_precision<fsdp::bf16, float, float>>;
  using bf16_bf16 = fake_group<fsdp::bf16, fsdp::mixed_precision<fsdp::bf16, fsdp::bf16, float>>;
  check_traffic(measure<bf16_f32>(4, {}).traffic, formula(4, 4, 2, 2, 4, 3));
  check_traffic(measure<bf16_bf16>(3, {}).traffic, formula(3, 3, 2, 2, 2, 3));
  check_traffic(measure<bf16_f32>(4, {.sharding = fsdp::hybrid_shard(2)}).traffic, formula(4, 2, 2, 2, 4, 3));
}

TEST_CASE("memory: forward peak is (1 + prefetch) buckets at most, and exactly what prefetch keeps alive") {
  using pf = fake_group<float>;
  const auto p = padded_units(4);  // 128, 256, 512, 256 elements
  const std::size_t largest = *std::max_element(p.begin(), p.end()) * 4;
  // No prefetch: one bucket at a time.
  const auto m0 = measure<pf>(4, {.prefetch = {.forward = 0, .backward = 0}});
  CHECK(m0.forward_peak == largest);
  // Prefetch 1: the bucket in use and the next one, never more.
  const auto m1 = measure<pf>(4, {.prefetch = {.forward = 1, .backward = 1}});
  std::size_t pair = 0;
  for (std::size_t i = 0; i + 1 < p.size(); ++i) pair = std::max(pair, (p[i] + p[i + 1]) * 4);
  CHECK(m1.forward_peak == pair);
  CHECK(m1.forward_peak <= 2 * largest);  // DESIGN.md: (1 + prefetch) x largest bucket, FSDP2 pins 3x
  // Backward: (1 + prefetch) gathered buckets + the gradient bucket being computed + one
  // reduction in flight (its gradient buffer and reduce-scatter output shard).
  CHECK(m0.backward_peak <= largest + largest + (largest + largest / 4));
  CHECK(m1.backward_peak <= 2 * largest + largest + (largest + largest / 4));
  CHECK(m1.backward_peak >= 2 * p[3] * 4);  // at least one gathered bucket plus its gradients
}

TEST_CASE("memory: the measured peaks stay within shard_group::transient_memory_bound for every strategy") {
  auto check = [](auto tag, int n, auto opts) {
    using G = typename decltype(tag)::type;
    const auto m = measure<G>(n, opts);
    // Recompute the bound on one rank through the group itself.
    typename G::memory_bound bound{};
    {
      fake_communicator comm = fake_rank(0, n, opts.sharding);
      model<typename G::param_type> mm;
      G g{comm, {}, opts};
      mm.register_with(g);
      g.finalize(per_shard_init());
      if (comm.rank() == 0) bound = g.transient_memory_bound();
    }
    CHECK(m.forward_peak <= bound.forward);
    CHECK(m.backward_peak <= bound.backward);
  };
  using f32 = fake_group<float>;
  check(std::type_identity<f32>{}, 4, f32::options{});
  check(std::type_identity<f32>{}, 4, f32::options{.sharding = fsdp::shard_grad_op()});
  using mixed = fake_group<fsdp::bf16, fsdp::mixed_precision<fsdp::bf16, float, float>>;
  check(std::type_identity<mixed>{}, 3, mixed::options{});
  check(std::type_identity<f32>{}, 4, f32::options{.sharding = fsdp::hybrid_shard(2)});
}

TEST_CASE("memory: full_shard's sharded state is 1/N of no_shard's") {
  using full = fake_group<float>;
  for (int n : {2, 4, 8}) {
    CAPTURE(n);
    const auto f = measure<full>(n, {}).persistent;
    const auto d = measure<full>(n, {.sharding = fsdp::no_shard()}).persistent;
    // master + gradient shard + two AdamW moments, 4 bytes each, per padded element.
    CHECK(d == 4 * 4 * total_padded(n));
    CHECK(f * static_cast<std::size_t>(n) == d);
  }
}

TEST_CASE("prefetch: the order recorded in the first step drives prefetching; an explicit order works from step 0") {
  using pf = fake_group<float>;
  const auto p = padded_units(2);
  std::size_t pair = 0;
  for (std::size_t i = 0; i + 1 < p.size(); ++i) pair = std::max(pair, (p[i] + p[i + 1]) * 4);
  const std::size_t largest = *std::max_element(p.begin(), p.end()) * 4;
  for (bool explicit_order : {false, true}) {
    CAPTURE(explicit_order);
    std::vector<std::size_t> first_step_peak(2), recorded(2);
    std::vector<int> order;
    for (int rank = 0; rank < 2; ++rank) {
      fake_communicator comm{rank, 2};
      model<float> m;
      pf::options opts{.prefetch = {.forward = 1, .backward = 1}};
      if (explicit_order) opts.prefetch.forward_units = {0, 1, 2, 3};
      pf g{comm, {}, opts};
      m.register_with(g);
      g.finalize(per_shard_init());
      for (int step = 0; step < 2; ++step) {
        g.device().reset_peak_memory();
        for (int u = 0; u < 4; ++u) auto s = g.forward(u);
        (step == 0 ? first_step_peak : recorded)[static_cast<std::size_t>(comm.rank())] = g.memory().transient_peak;
        for (int u = 4; u-- > 0;) auto s = g.backward(u);
        g.finish_backward();
      }
      if (comm.rank() == 0) order.assign(g.forward_order().begin(), g.forward_order().end());
    }
    CHECK(order == std::vector<int>{0, 1, 2, 3});
    // Without an explicit order nothing is known in step 0: one bucket at a time.
    CHECK(first_step_peak[0] == (explicit_order ? pair : largest));
    CHECK(recorded[0] == pair);
  }
}

TEST_CASE("memory: equal-sized buckets stay within the backward bound (one reduction in flight)") {
  // Equal buckets are the worst case for the backward bound: a new reduction is issued while
  // the previous one may still run. Checked for f32 and for bf16 params with f32 reduce.
  auto run = [](auto tag) {
    using G = typename decltype(tag)::type;
    using T = typename G::param_type;
    std::vector<std::size_t> fwd(2), bwd(2);
    typename G::memory_bound bound{};
    for (int rank = 0; rank < 2; ++rank) {
      fake_communicator comm{rank, 2};
      std::vector<std::unique_ptr<fsdp::buffer<T>>> ps;
      for (int u = 0; u < 6; ++u) ps.push_back(std::make_unique<fsdp::buffer<T>>(4096));
      G g{comm, {}, {.prefetch = {.forward = 1, .backward = 1}}};
      for (auto& p : ps) g.add_unit({p.get()});
      g.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); }));
      if (comm.rank() == 0) bound = g.transient_memory_bound();
      for (int step = 0; step < 3; ++step) {
        g.device().reset_peak_memory();
        for (int u = 0; u < 6; ++u) auto s = g.forward(u);
        fwd[static_cast<std::size_t>(comm.rank())] = std::max(fwd[static_cast<std::size_t>(comm.rank())], g.memory().transient_peak);
        g.device().reset_peak_memory();
        for (int u = 6; u-- > 0;) {
          auto s = g.backward(u);
          for (auto& x : ps[static_cast<std::size_t>(u)]->grads()) x = fsdp::convert<T>(1.0f);
        }
        g.finish_backward();
        bwd[static_cast<std::size_t>(comm.rank())] = std::max(bwd[static_cast<std::size_t>(comm.rank())], g.memory().transient_peak);
        g.zero_grad();
      }
    }
    const std::size_t bucket = 4096 * sizeof(T);  // 4096 is a multiple of lcm(2, 128): no padding
    CHECK(bound.forward == 2 * bucket);
    for (int r = 0; r < 2; ++r) {
      CHECK(fwd[static_cast<std::size_t>(r)] <= bound.forward);
      CHECK(bwd[static_cast<std::size_t>(r)] <= bound.backward);
    }
  };
  run(std::type_identity<fake_group<float>>{});
  run(std::type_identity<fake_group<fsdp::bf16, fsdp::mixed_precision<fsdp::bf16, float, float>>>{});
}
