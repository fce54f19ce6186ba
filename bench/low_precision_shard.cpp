// The kept low-precision shard (shard_group's options::keep_low_precision_shard) against casting
// the f32 master shard at every gather: one bf16 step of an engine without compute (forward and
// backward scopes over 8 units, full_shard, so two gathers a unit, then AdamW), two groups alike
// but for the option, their steps timed alternately in the same run.
//
//   fsdp_bench --benchmark_filter=low_precision_shard
//
// Counters (medians over the iterations, rank 0's wall time): cast_ms and kept_ms, a step of
// each group; cast/kept, their ratio (above 1: keeping the copy is faster).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <benchmark/benchmark.h>

#include <fsdp/fsdp.hpp>

namespace {

using group_t = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>>;
constexpr int units = 8;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One group with its parameters and optimizer.
struct trained {
  trained(fsdp::threads::communicator& comm, std::size_t numel, bool keep) : group(comm, {}, {.keep_low_precision_shard = keep}) {
    for (int u = 0; u < units; ++u) params.push_back(std::make_unique<fsdp::buffer<fsdp::bf16>>(numel, "w"));
    for (auto& p : params) group.add_unit({p.get()});
    group.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> out) { std::fill(out.begin(), out.end(), 0.01f); }));
    opt.emplace(group, fsdp::adamw_options{});
  }
  // The engine reads one element in forward and writes one gradient element in backward.
  void step() {
    for (int u = 0; u < units; ++u) {
      auto in_use = group.forward(u);
      benchmark::DoNotOptimize(params[static_cast<std::size_t>(u)]->data()[0]);
    }
    for (int u = units; u-- > 0;) {
      auto in_use = group.backward(u);
      params[static_cast<std::size_t>(u)]->grad()[0] = fsdp::convert<fsdp::bf16>(1.0f);
    }
    opt->step();
    opt->zero_grad();
  }
  std::vector<std::unique_ptr<fsdp::buffer<fsdp::bf16>>> params;
  group_t group;
  std::optional<fsdp::adamw<group_t>> opt;
};

void low_precision_shard(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const auto numel = static_cast<std::size_t>(state.range(1));
  const benchmark::IterationCount iterations = state.max_iterations;
  std::vector<double> cast_s, kept_s;
  try {
    fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
      trained cast(comm, numel, false), kept(comm, numel, true);
      cast.step();  // records the unit order; first touch
      kept.step();
      auto timed = [&](trained& t, std::vector<double>& into) {
        const auto t0 = std::chrono::steady_clock::now();
        t.step();
        if (comm.rank() == 0) into.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      };
      auto one_iteration = [&](benchmark::IterationCount it) {
        if (it % 2 == 0) {
          timed(cast, cast_s);
          timed(kept, kept_s);
        } else {
          timed(kept, kept_s);
          timed(cast, cast_s);
        }
      };
      if (comm.rank() == 0) {
        benchmark::IterationCount it = 0;
        for (auto _ : state) one_iteration(it++);
      } else {
        for (benchmark::IterationCount it = 0; it < iterations; ++it) one_iteration(it);
      }
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.counters["cast_ms"] = median(cast_s) * 1e3;
  state.counters["kept_ms"] = median(kept_s) * 1e3;
  state.counters["cast/kept"] = median(kept_s) > 0 ? median(cast_s) / median(kept_s) : 0.0;
}

}  // namespace

BENCHMARK(low_precision_shard)
    ->ArgNames({"ranks", "numel"})
    ->Args({1, 1 << 20})
    ->Args({2, 1 << 20})
    ->Iterations(20)
    ->Unit(benchmark::kMillisecond);
