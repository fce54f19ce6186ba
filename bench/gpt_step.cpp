// Step efficiency on the GPT model of the main job (examples/gpt): the training step time of
// full_shard and grad_op divided by that of no_shard (DDP) on the same ranks, and by the step
// time of one rank alone with the same per-rank batch (the work one rank does is the same; what
// differs is the communication and fsdp's scheduling). Measured in one run, interleaved: each
// round trains a few steps of every configuration in turn; the figure is the median step time
// over rounds (first step of each run dropped: it records the unit order and warms caches).
//
//   fsdp_bench --benchmark_filter=gpt_step
//
// `matmul:0` computes the matrix products with the plain loops the parity tests use, `matmul:1`
// with OpenBLAS (registered only where CMake found it, as train_gpt's default `--matmul blas`).
// The faster compute side exposes communication, so full sharding also runs without prefetch
// (prefetch 0/0) and with the planner's plan (train_gpt's --bucket auto: profile 3 steps, then
// auto_bucket's greedy plan), and `*_wait` is the share of the step the slowest rank spent
// blocked on communication: what prefetch and the planner leave exposed.
//
// On this 2-core machine the 4 rank threads share 2 cores, so the ratio to one rank includes
// the oversubscription; the ratios to DDP compare like with like.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "gpt/train.hpp"

namespace {

using group_t = fsdp::shard_group<fsdp::buffer<float>, fsdp::full_precision<float>>;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Medians of the seconds `a` and `b` take, timed alternately, 5 rounds per benchmark iteration:
// the kernel benchmarks below compare two ways in the same run.
template <class A, class B>
std::pair<double, double> interleaved_medians(benchmark::State& state, A&& a, B&& b) {
  auto time = [](auto& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> ta, tb;
  for (auto _ : state)
    for (int round = 0; round < 5; ++round) {
      ta.push_back(time(a));
      tb.push_back(time(b));
    }
  return {median(ta), median(tb)};
}

// Per step (steps 1.. of one short run): the step time (seconds, slowest rank) and the share
// of it the slowest rank waited on communication.
struct samples {
  std::vector<double> step_s, wait_share;
  double step() const { return median(step_s); }
  double wait() const { return median(wait_share); }
};

void run(samples& into, int ranks, const gpt::run_options& o, group_t::options opts, const gpt::corpus& text) {
  fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
    const gpt::run_result r = gpt::train_rank<group_t>(comm, o, opts, text);
    if (comm.rank() != 0) return;
    for (std::size_t s = 1; s < r.steps.size(); ++s) {
      const double t = r.steps[s].step_s();
      double wait = 0;
      for (const auto& rank : r.steps[s].ranks) wait = std::max(wait, rank.wait_s);
      into.step_s.push_back(t);
      into.wait_share.push_back(t > 0 ? wait / t : 0.0);
    }
  });
}

void gpt_step(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const int per_rank_batch = static_cast<int>(state.range(1));
  const bool blas = state.range(2) != 0;
  gpt::corpus text;
  try {
    text = gpt::load_corpus(gpt::default_corpus_dir, 64);
  } catch (const fsdp::error& e) {
    state.SkipWithError(e.what());
    return;
  }
  if (blas) gpt::enable_blas();  // off again at the end (the loops are the default)
  gpt::run_options o;  // the main job's model: 4 layers, dim 64, 4 heads, context 64
  o.steps = 4;
  o.eval_every = 0;
  gpt::run_options single = o, planned = o;
  o.batch = planned.batch = per_rank_batch * ranks;
  single.batch = per_rank_batch;
  planned.auto_plan = fsdp::auto_bucket{};
  const group_t::options full{.sharding = fsdp::full_shard()};
  samples f, no_prefetch, plan, g, d, one;
  for (auto _ : state) {
    for (int round = 0; round < 3; ++round) {
      run(f, ranks, o, full, text);
      run(no_prefetch, ranks, o, {.sharding = fsdp::full_shard(), .prefetch = {.forward = 0, .backward = 0}}, text);
      run(plan, ranks, planned, full, text);
      run(g, ranks, o, {.sharding = fsdp::shard_grad_op()}, text);
      run(d, ranks, o, {.sharding = fsdp::no_shard()}, text);
      run(one, 1, single, full, text);
    }
  }
  gpt::use_blas = false;  // the other benchmarks' model runs as before
  const double tokens = static_cast<double>(per_rank_batch) * ranks * o.model.seq;
  state.counters["full_ms"] = f.step() * 1e3;
  state.counters["ddp_ms"] = d.step() * 1e3;
  state.counters["one_rank_ms"] = one.step() * 1e3;
  state.counters["full_tok/s"] = tokens / f.step();
  state.counters["ddp_tok/s"] = tokens / d.step();
  state.counters["full/ddp"] = f.step() / d.step();
  state.counters["grad_op/ddp"] = g.step() / d.step();
  state.counters["full/one_rank"] = f.step() / one.step();
  state.counters["no_prefetch/full"] = no_prefetch.step() / f.step();
  state.counters["planned/full"] = plan.step() / f.step();
  state.counters["full_wait"] = f.wait();
  state.counters["no_prefetch_wait"] = no_prefetch.wait();
  state.counters["planned_wait"] = plan.wait();
  state.counters["ddp_wait"] = d.wait();
  state.SetLabel(std::string(blas ? "OpenBLAS" : "loops") + " model=4x64 seq=64 fp32; medians of 9 steps per config");
}

}  // namespace

BENCHMARK(gpt_step)
    ->ArgNames({"ranks", "per_rank_batch", "matmul"})
    ->Args({2, 4, 0})
    ->Args({4, 4, 0})
    ->Apply([](benchmark::internal::Benchmark* b) {
      if (gpt::have_blas) b->Args({2, 4, 1})->Args({4, 4, 1});
    })
    ->Iterations(1)
    ->Repetitions(1)
    ->Unit(benchmark::kMillisecond);

namespace {

// The GPT's attention alone, forward and backward, with the plain loops and with OpenBLAS
// (gpt/kernels.hpp), interleaved over 5 rounds; the figure is blas/loops of the median times,
// at the shapes of issue 34's comparison with FSDP2 (context 64, 4 heads, dims 64 to 512).
//
//   fsdp_bench --benchmark_filter=gpt_attention
void gpt_attention(benchmark::State& state) {
  const int B = 4, T = static_cast<int>(state.range(1)), C = static_cast<int>(state.range(0)), H = 4;
  std::vector<float> qkv(static_cast<std::size_t>(B * T * 3 * C)), dout(static_cast<std::size_t>(B * T * C));
  for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = 0.01f * static_cast<float>(i % 97);
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = 0.02f * static_cast<float>(i % 89);
  std::vector<float> out(dout.size()), att(static_cast<std::size_t>(B * H * T * T)), dqkv(qkv.size());
  auto pass = [&](bool blas) {
    gpt::use_blas = blas;
    gpt::kernels::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, H);
    gpt::kernels::attention_backward(dqkv.data(), dout.data(), qkv.data(), att.data(), B, T, C, H);
    gpt::use_blas = false;
  };
  auto with_loops = [&] { pass(false); };
  auto with_blas = [&] { pass(true); };
  const auto [loops, blas] = interleaved_medians(state, with_loops, with_blas);
  state.counters["loops_ms"] = loops * 1e3;
  state.counters["blas_ms"] = blas * 1e3;
  state.counters["loops/blas"] = loops / blas;
  state.SetLabel("B=4 H=4, forward + backward, medians of 5 interleaved rounds");
}

}  // namespace

namespace {

// The GELU, forward and backward (gpt/kernels.hpp, whose tanh is plain arithmetic that
// vectorizes), against the same loops calling std::tanh (what they were before 2026-11-28),
// interleaved over 5 rounds on 1 Mi elements; the figure is std_tanh/kernels of the medians.
//
//   fsdp_bench --benchmark_filter=gpt_gelu
void gpt_gelu(benchmark::State& state) {
  const std::size_t n = std::size_t{1} << 20;
  std::vector<float> in(n), out(n), din(n), dout(n, 1.0f);
  for (std::size_t i = 0; i < n; ++i) in[i] = -6.0f + 12.0f * static_cast<float>(i) / static_cast<float>(n);
  const float k = std::sqrt(2.0f / 3.14159265358979f);
  auto with_std_tanh = [&] {
    for (std::size_t i = 0; i < n; ++i) {
      const float x = in[i];
      out[i] = 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
    }
    std::copy(dout.begin(), dout.end(), din.begin());  // as the kernel, in place on a fresh gradient
    for (std::size_t i = 0; i < n; ++i) {
      const float x = in[i], th = std::tanh(k * (x + 0.044715f * x * x * x));
      din[i] *= (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * k * (1.0f + 3.0f * 0.044715f * x * x));
    }
  };
  auto with_kernels = [&] {
    gpt::kernels::gelu_forward(out.data(), in.data(), n);
    std::copy(dout.begin(), dout.end(), din.begin());
    gpt::kernels::gelu_backward(din.data(), in.data(), n);
  };
  const auto [std_tanh, kernels] = interleaved_medians(state, with_std_tanh, with_kernels);
  benchmark::DoNotOptimize(din.data());
  state.counters["std_tanh_ns/elem"] = std_tanh * 1e9 / static_cast<double>(n);
  state.counters["kernels_ns/elem"] = kernels * 1e9 / static_cast<double>(n);
  state.counters["std_tanh/kernels"] = std_tanh / kernels;
  state.SetLabel("1 Mi elements, forward + backward, medians of 5 interleaved rounds");
}

}  // namespace

BENCHMARK(gpt_gelu)->Iterations(1)->Unit(benchmark::kMillisecond);

#if GPT_OPENBLAS
BENCHMARK(gpt_attention)
    ->ArgNames({"dim", "seq"})
    ->Args({64, 64})
    ->Args({256, 64})
    ->Args({512, 64})
    ->Args({256, 256})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
#endif
