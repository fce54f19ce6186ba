// fsdp_bench accounting: the per-rank traffic and memory figures of the parity test model
// (tests/common/mlp.hpp: 4 units of uneven sizes) on 4 thread ranks, for each sharding strategy
// and each mode that changes them (HSDP accumulation, the int8 and fp8 all-gathers, frozen
// parameters, hpZ, offload), next to the bounds
// shard_group::transient_memory_bound() promises. These are counts, not timings: they are exact
// and do not depend on the machine.
//
//   build/release/bench/fsdp_bench accounting
#include <array>
#include <cstdio>

#include "common/mlp.hpp"

namespace {
using namespace fsdp_test;
// `micro` micro-batches per step, each reduced; with `all_reduce_last_only` the replicas'
// all-reduce runs on the last one only (set_requires_all_reduce), and `held` is the persistent
// bytes the held sums add meanwhile.
template <class Group>
void report(const char* name, typename Group::options opts, int micro = 1, bool all_reduce_last_only = false,
            const std::vector<std::pair<int, int>>& frozen = {}) {
  const int n = 4;
  std::vector<std::array<std::size_t, 7>> per(n);
  fsdp::threads::world{n}.run([&](fsdp::threads::communicator& comm) {
    using T = typename Group::param_type;
    model<T> m; Group g{comm, {}, opts}; m.register_with(g, frozen); g.finalize(per_shard_init());
    fsdp::adamw opt{g, {}};
    const auto& L = shapes(); const int local = batch_global / n;
    fsdp::traffic_counters start; std::size_t fpk = 0, bpk = 0, held = 0;
    for (int step = 0; step < 3; ++step) {
      if (step == 1) start = g.traffic();
      std::vector<float> x, t, dy; batch_slice(step, comm.rank() * local, local, x, t);
      std::vector<layer_cache> c(L.size());
      auto forward = [&] { for (std::size_t u = 0; u < L.size(); ++u) { auto s = g.forward(int(u)); layer_forward(L[u], m.ptr(u,0), m.ptr(u,1), m.ptr(u,2), u ? c[u-1].y : x, local, c[u]); } };
      g.device().reset_peak_memory();
      forward();
      if (step) fpk = std::max(fpk, g.memory().transient_peak);
      g.device().reset_peak_memory();
      const std::size_t state = g.memory().persistent_live;
      for (int k = 0; k < micro; ++k) {  // the same micro-batch again: the counts do not depend on the data
        g.set_requires_all_reduce(!all_reduce_last_only || k + 1 == micro);
        if (k) forward();
        loss_and_grad(c.back().y, t, local, dy);
        for (std::size_t u = L.size(); u-- > 0;) { auto s = g.backward(int(u)); dy = layer_backward(L[u], m.ptr(u,0), m.ptr(u,2), m.grad(u,0), m.grad(u,1), m.grad(u,2), c[u], dy, local); }
        if (k + 1 < micro) held = std::max(held, g.memory().persistent_live - state);
      }
      g.finish_backward();
      if (step) bpk = std::max(bpk, g.memory().transient_peak);
      opt.step(); opt.zero_grad();
    }
    auto tr = g.traffic() - start;
    auto b = g.transient_memory_bound();
    per[comm.rank()] = {tr.all_gather / 2, tr.reduce_scatter / 2, tr.all_reduce / 2, fpk, bpk, g.memory().persistent_live, g.memory().offloaded_live};
    if (comm.rank() == 0) std::printf("%-40s AG %6zu RS %6zu AR %6zu B/step | fwd peak %6zu (bound %6zu) bwd peak %6zu (bound %6zu) | sharded state %6zu B, held %5zu B, offloaded %5zu B\n",
      name, per[0][0], per[0][1], per[0][2], fpk, b.forward, bpk, b.backward, per[0][5], held, per[0][6]);
  });
}
}  // namespace

// argv[0] is "accounting"; it takes no options.
int run_accounting_command(int argc, char** argv) {
  if (argc > 1) {
    std::fprintf(stderr, "fsdp_bench accounting takes no options, got '%s'\n", argv[1]);
    return 2;
  }
  std::printf("per rank per step (bytes), steady state, 4 thread ranks; peaks are transient bytes\n");
  using F = fsdp::shard_group<fsdp::buffer<float>>;
  report<F>("full_shard f32 prefetch 1", {});
  report<F>("full_shard f32 no prefetch", {.prefetch = fsdp::no_prefetch()});
  report<F>("grad_op f32", {.sharding = fsdp::shard_grad_op()});
  report<F>("hybrid 2x2 f32", {.sharding = fsdp::hybrid_shard(2)});
  report<F>("no_shard (DDP) f32", {.sharding = fsdp::no_shard()});
  report<F>("hybrid 2x2 f32, 3 micro, AR each", {.sharding = fsdp::hybrid_shard(2)}, 3);
  report<F>("hybrid 2x2 f32, 3 micro, AR on last", {.sharding = fsdp::hybrid_shard(2)}, 3, true);
  report<fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>>>("full_shard bf16/f32/f32", {});
  F::options int8;
  int8.collectives.all_gather = fsdp::int8_all_gather{};
  report<F>("full_shard f32, int8 all-gather", int8);
  F::options fp8;
  fp8.collectives.all_gather = fsdp::fp8_all_gather{};
  report<F>("full_shard f32, fp8 all-gather", fp8);
  report<F>("full_shard f32, hpZ to 2 ranks", {.sharding = {.reshard_after_forward_to = 2}});
  report<F>("full_shard f32, offload units 0 and 2", {.offload = {.units = {0, 2}}});
  // Unit 0 all frozen and unit 2's weight (341 of its 372 elements): the parameters train_config
  // calls frozen in tests/group/test_frozen.cpp.
  report<F>("full_shard f32, u0 + u2.p0 frozen", {}, 1, false, {{0, 0}, {0, 1}, {2, 0}});
  return 0;
}
