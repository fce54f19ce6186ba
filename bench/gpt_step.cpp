// Step efficiency on the GPT model of the main job (examples/gpt): the training step time of
// full_shard and grad_op divided by that of no_shard (DDP) on the same ranks, and by the step
// time of one rank alone with the same per-rank batch (the work one rank does is the same; what
// differs is the communication and fsdp's scheduling). Measured in one run, interleaved: each
// round trains a few steps of every configuration in turn; the figure is the median step time
// over rounds (first step of each run dropped: it records the unit order and warms caches).
//
//   fsdp_bench --benchmark_filter=gpt_step
//
// On this 2-core machine the 4 rank threads share 2 cores, so the ratio to one rank includes
// the oversubscription; the ratios to DDP compare like with like.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpt/train.hpp"

namespace {

using group_t = fsdp::shard_group<fsdp::buffer<float>, fsdp::full_precision<float>>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Step times (seconds, slowest rank) of steps 1.. of one short run.
template <class Group>
std::vector<double> step_times(int ranks, const gpt::run_options& o, typename Group::options opts, const gpt::corpus& text) {
  std::vector<double> out;
  fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
    const gpt::run_result r = gpt::train_rank<Group>(comm, o, opts, text);
    if (comm.rank() == 0)
      for (std::size_t s = 1; s < r.steps.size(); ++s) out.push_back(r.steps[s].step_s());
  });
  return out;
}

void gpt_step(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const int per_rank_batch = static_cast<int>(state.range(1));
  gpt::corpus text;
  try {
    text = gpt::load_corpus(gpt::default_corpus_dir, 64);
  } catch (const fsdp::error& e) {
    state.SkipWithError(e.what());
    return;
  }
  gpt::run_options o;  // the main job's model: 4 layers, dim 64, 4 heads, context 64
  o.steps = 4;
  o.eval_every = 0;
  gpt::run_options single = o;
  o.batch = per_rank_batch * ranks;
  single.batch = per_rank_batch;
  std::vector<double> full, grad_op, ddp, one;
  for (auto _ : state) {
    for (int round = 0; round < 3; ++round) {
      for (double t : step_times<group_t>(ranks, o, {.sharding = fsdp::full_shard()}, text)) full.push_back(t);
      for (double t : step_times<group_t>(ranks, o, {.sharding = fsdp::shard_grad_op()}, text)) grad_op.push_back(t);
      for (double t : step_times<group_t>(ranks, o, {.sharding = fsdp::no_shard()}, text)) ddp.push_back(t);
      for (double t : step_times<group_t>(1, single, {.sharding = fsdp::full_shard()}, text)) one.push_back(t);
    }
  }
  const double f = median(full), g = median(grad_op), d = median(ddp), s = median(one);
  state.counters["full_ms"] = f * 1e3;
  state.counters["grad_op_ms"] = g * 1e3;
  state.counters["ddp_ms"] = d * 1e3;
  state.counters["one_rank_ms"] = s * 1e3;
  state.counters["full/ddp"] = f / d;
  state.counters["grad_op/ddp"] = g / d;
  state.counters["full/one_rank"] = f / s;
  state.counters["grad_op/one_rank"] = g / s;
  state.SetLabel("ranks=" + std::to_string(ranks) + " per_rank_batch=" + std::to_string(per_rank_batch) +
                 " model=4x64 seq=64 fp32; medians of 9 steps per config");
}

}  // namespace

BENCHMARK(gpt_step)->ArgNames({"ranks", "per_rank_batch"})->Args({2, 4})->Args({4, 4})->Iterations(1)->Repetitions(1)->Unit(benchmark::kMillisecond);
