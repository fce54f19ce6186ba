// fsdp_bench overlap: the planner's plans run for real on the GPT training program, with the
// threads backend's link model on (so communication takes time and hides, or not, behind
// compute on this CPU), against what the simulator predicted for them.
//
//   fsdp_bench overlap [--ranks 4] [--latency-ms 8] [--mbps 400] [--limit-mib 0] [--rounds 2] [--steps 8]
//
// 1. Profile: 3 steps of the model with one bucket per unit (after one that records the unit
//    order), averaged over ranks (shard_group::step_trace), and schedule::calibrate on the same
//    link: the trace and cost model every plan below is made from and predicted with.
// 2. Plans: no prefetch, FSDP2's per-unit prefetch 1, the SimpleFSDP-style greedy plan and the
//    searched best plan, under a per-rank memory limit (default: the per-unit plan's simulated
//    peak plus one block, so that merging is possible but not free).
// 3. Run every plan `--steps` steps per round, the plans interleaved, `--rounds` rounds, through
//    shard_group's options.plan (the runtime replays the plan's buckets, issue points and
//    reduction waits).
//    Measured: median step time (start to next start: the whole cycle, as the simulator's step
//    includes what happens between steps), median time blocked on communication, peak fsdp
//    memory. The first two steps of each run are dropped (the first records the order and runs
//    without prefetch), and the last has no next start.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/schedule/planner.hpp>
#include <fsdp/schedule/simulator.hpp>

#include "gpt/train.hpp"

namespace {

struct overlap_options {
  int ranks = 4;
  double latency_ms = 8;
  double mbps = 400;
  double limit_mib = 0;  // 0: the per-unit plan's peak plus one block
  int rounds = 2;
  int steps = 8;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct measured {
  std::vector<double> step_s, wait_s;
  std::uint64_t peak = 0;
};

using group_t = fsdp::shard_group<fsdp::buffer<float>>;  // full_shard, one bucket per unit, or a plan

}  // namespace

int run_overlap_command(int argc, char** argv) {
  overlap_options oo;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") {
      std::puts("fsdp_bench overlap [--ranks 4] [--latency-ms 8] [--mbps 400] [--limit-mib 0] [--rounds 2] [--steps 8]");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "overlap: missing value for %s\n", a.c_str());
      return 2;
    }
    const double v = std::atof(argv[++i]);
    if (a == "--ranks") oo.ranks = static_cast<int>(v);
    else if (a == "--latency-ms") oo.latency_ms = v;
    else if (a == "--mbps") oo.mbps = v;
    else if (a == "--limit-mib") oo.limit_mib = v;
    else if (a == "--rounds") oo.rounds = static_cast<int>(v);
    else if (a == "--steps") oo.steps = static_cast<int>(v);
    else {
      std::fprintf(stderr, "overlap: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (oo.ranks < 1 || oo.rounds < 1 || oo.steps < 4 || !(oo.mbps > 0) || oo.latency_ms < 0) {
    std::fprintf(stderr, "overlap: needs --ranks >= 1, --rounds >= 1, --steps >= 4, --mbps > 0, --latency-ms >= 0\n");
    return 2;
  }
  try {
    const gpt::corpus text = gpt::load_corpus(gpt::default_corpus_dir, 64);
    gpt::run_options o;  // the main job's model and batch
    o.eval_every = 0;
    o.steps = oo.steps;
    const fsdp::threads::world_options world{.link = {.alpha_s = oo.latency_ms * 1e-3, .beta_bytes_per_s = oo.mbps * 1e6}};

    // 1. Profile once: the trace and cost model of every plan.
    fsdp::schedule::step_trace trace;
    fsdp::schedule::cost_model cost;
    fsdp::threads::world{oo.ranks, world}.run([&](fsdp::threads::communicator& comm) {
      gpt::model<float> m(o.model);
      gpt::profile_result p = gpt::profile_for_plan<group_t>(comm, o, {}, m, text);
      if (comm.rank() == 0) trace = std::move(p.trace), cost = std::move(p.cost);
    });

    // 2. The plans.
    const auto per_unit = fsdp::schedule::per_unit_prefetch(trace, 1, 1);
    std::size_t limit = static_cast<std::size_t>(oo.limit_mib * (1 << 20));
    if (limit == 0) {
      std::size_t block = 0;
      for (std::size_t n : trace.units.back().param_numels) block += n * sizeof(float);
      limit = fsdp::schedule::simulate(trace, cost, per_unit).peak_bytes + block;
    }
    std::vector<fsdp::schedule::plan> plans = {fsdp::schedule::per_unit_prefetch(trace, 0, 0), per_unit,
                                               fsdp::schedule::greedy_plan(trace, cost, limit),
                                               fsdp::schedule::best_plan(trace, cost, limit)};
    plans[0].name = "no prefetch", plans[1].name = "per-unit prefetch 1", plans[2].name = "greedy", plans[3].name = "best";

    // 3. Run them, interleaved.
    std::vector<measured> got(plans.size());
    for (int round = 0; round < oo.rounds; ++round)
      for (std::size_t k = 0; k < plans.size(); ++k)
        fsdp::threads::world{oo.ranks, world}.run([&](fsdp::threads::communicator& comm) {
          const gpt::run_result r = gpt::train_rank<group_t>(comm, o, {.plan = plans[k]}, text);
          if (comm.rank() != 0) return;
          for (std::size_t s = 2; s + 1 < r.steps.size(); ++s) {
            const auto& st = r.steps[s];
            // The whole cycle, start to next start (the simulator's step: hooks, compute, the
            // optimizer and what the loop does between steps), on rank 0.
            got[k].step_s.push_back(r.steps[s + 1].ranks[0].start_s - st.ranks[0].start_s);
            double w = 0;
            for (const auto& x : st.ranks) w += x.wait_s / static_cast<double>(st.ranks.size());
            got[k].wait_s.push_back(w);
            for (const auto& x : st.ranks) got[k].peak = std::max(got[k].peak, x.peak);
          }
        });

    std::printf("overlap: GPT (%d layers, dim %d, context %d, global batch %d), %d thread ranks, full_shard fp32\n", o.model.layers,
                o.model.dim, o.model.seq, o.batch, oo.ranks);
    std::printf("link model %.3g ms + bytes / %.4g MB/s; calibrated: %s\n", oo.latency_ms, oo.mbps, fsdp::schedule::to_string(cost).c_str());
    std::printf("memory limit %.3f MiB per rank; medians of %d steps per plan over %d interleaved rounds\n\n",
                static_cast<double>(limit) / (1 << 20), (oo.steps - 3) * oo.rounds, oo.rounds);
    std::printf("%-20s %7s  %-22s %9s %9s %7s %10s %10s %9s %9s\n", "plan", "buckets", "bucket units", "pred ms", "meas ms", "error",
                "pred exp", "meas wait", "pred MiB", "meas MiB");
    for (std::size_t k = 0; k < plans.size(); ++k) {
      const auto sim = fsdp::schedule::simulate(trace, cost, plans[k]);
      const std::string buckets = fsdp::schedule::describe_buckets(plans[k]);
      const std::string units = buckets.substr(buckets.find('['));  // "[0 | 1-2 | 3 | 4]"
      const double meas = median(got[k].step_s);
      std::printf("%-20s %7d  %-22s %9.1f %9.1f %+6.1f%% %10.1f %10.1f %9.3f %9.3f\n", plans[k].name.c_str(), plans[k].num_buckets(),
                  units.c_str(), sim.step_s * 1e3, meas * 1e3, 100 * (sim.step_s - meas) / meas,
                  sim.exposed_comm_s * 1e3, median(got[k].wait_s) * 1e3, static_cast<double>(sim.peak_bytes) / (1 << 20),
                  static_cast<double>(got[k].peak) / (1 << 20));
    }
    const double base = median(got[1].step_s);
    std::printf("\nstep time / per-unit prefetch 1: greedy %.3f, best %.3f (below 1: the plan is faster)\n", median(got[2].step_s) / base,
                median(got[3].step_s) / base);
    std::printf("measured peak under the limit: %s\n",
                std::all_of(got.begin() + 2, got.end(), [&](const measured& m) { return m.peak <= limit; }) ? "yes (greedy, best)" : "NO");
  } catch (const fsdp::error& e) {
    std::fprintf(stderr, "overlap: %s\n", e.what());
    return 1;
  }
  return 0;
}
