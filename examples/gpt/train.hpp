#pragma once
// gpt/train.hpp: one rank's training run of the GPT model on a shard_group, on any backend.
// train_gpt.cpp (the command-line program), the loss-parity test and the step benchmark use it.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.hpp>
#include <fsdp/schedule/auto_bucket.hpp>
#include <fsdp/schedule/calibrate.hpp>
#include <fsdp/schedule/simulator.hpp>

#include "gpt/data.hpp"
#include "gpt/model.hpp"

namespace gpt {

struct run_options {
  config model{};
  int steps = 200;
  int batch = 16;          // global batch (sequences), split evenly over the ranks
  float lr = 3e-3f;        // AdamW, peak learning rate
  int warmup = 10;         // steps of linear warm-up, then cosine decay to lr / 10
  float clip = 1.0f;       // global gradient-norm clipping (0: none)
  std::uint64_t seed = 1;  // initial values and batches
  int eval_every = 25;     // validation loss every k steps (0: never), and after the last
  int eval_batches = 2;    // global batches of validation text per evaluation
  int profile_steps = 3;   // auto_plan: steps timed (after one that records the order) to plan from
  //! When set, and the group's options carry no plan: profile first (profile_for_plan), then
  //! train with the plan this auto_bucket makes from that trace and cost model.
  std::optional<fsdp::auto_bucket> auto_plan{};
};

//! The learning rate of a step: linear warm-up over o.warmup steps, then a cosine decay from
//! o.lr to o.lr / 10 at the last step (what GPT-2-style training does).
inline float learning_rate(const run_options& o, int step) {
  const double warm = o.warmup > 0 ? std::min(1.0, (step + 1.0) / o.warmup) : 1.0;
  const double progress = o.steps > 1 ? static_cast<double>(step) / (o.steps - 1) : 0.0;
  const double decay = 0.1 + 0.9 * 0.5 * (1.0 + std::cos(3.141592653589793 * progress));
  return static_cast<float>(o.lr * warm * decay);
}

//! One rank's figures for one step. Trivially copyable: the ranks all-gather it as bytes.
struct rank_step {
  double loss = 0;                                          // mean over this rank's tokens
  double val_loss = std::numeric_limits<double>::quiet_NaN();  // NaN when not evaluated
  double step_s = 0;                                        // wall time of the step
  double start_s = 0;                                       // when it started, since the run's first step
  double wait_s = 0;                                        // blocked on communication
  std::uint64_t peak = 0;                                   // fsdp-managed bytes, peak in the step
  std::uint64_t persistent = 0;                             // sharded state bytes
  std::uint64_t sent = 0;                                   // bytes sent in the step
};

//! Every rank's figures for one step.
struct step_report {
  int step = 0;
  std::vector<rank_step> ranks;
  double loss() const {
    double s = 0;
    for (const auto& r : ranks) s += r.loss;
    return s / static_cast<double>(ranks.size());
  }
  double val_loss() const {
    double s = 0;
    for (const auto& r : ranks) s += r.val_loss;
    return s / static_cast<double>(ranks.size());
  }
  double step_s() const {  // a step is over when its slowest rank is
    double s = 0;
    for (const auto& r : ranks) s = std::max(s, r.step_s);
    return s;
  }
};

//! What a run reports as it goes. All optional.
template <class Group>
struct callbacks {
  std::function<void(const step_report&)> on_step{};  //!< rank 0, after each step
  std::function<void(const std::string&)> on_note{};  //!< rank 0: the plan auto_plan chose
  fsdp::timeline* timeline = nullptr;                 //!< the group records its spans here
  std::function<void(Group&)> at_end{};               //!< every rank, the group after the last step
};

//! What a run returns on every rank.
struct run_result {
  std::vector<step_report> steps;
  std::size_t model_numel = 0;    // parameters (wte once)
  std::string events;             // this rank's trace events (when a timeline was given)
  std::optional<fsdp::schedule::step_trace> trace;  // auto_plan: what the plan was made from
  std::optional<fsdp::schedule::cost_model> cost;
};

//! Each rank fills only its shard with the model's initial values (no full copy anywhere).
inline auto initial_values(const run_options& o) {
  return fsdp::init::per_shard([o](const fsdp::param_slice& s, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = initial_value(s.name, s.offset + i, o.model, o.seed);
  });
}

//! What a plan is made from: the trace of a few profiled steps and the links' cost model.
struct profile_result {
  fsdp::schedule::step_trace trace;
  fsdp::schedule::cost_model cost;
};

//! Times o.profile_steps steps (after one that records the unit order) with a throwaway group
//! of type Group on the same model, AdamW included, and measures the links with
//! schedule::calibrate: what auto_bucket plans from. Every rank returns the same figures.
template <class Group>
profile_result profile_for_plan(typename Group::comm_type& comm, const run_options& o, const typename Group::options& opts,
                                model<typename Group::param_type>& m, const corpus& text) {
  const int local = o.batch / comm.size();
  profile_result out;
  {
    Group probe{comm, {}, opts};
    add_units(probe, m);
    probe.finalize(initial_values(o));
    fsdp::adamw opt{probe, {.lr = o.lr, .weight_decay = 0.0f}};
    activations acts;
    for (int step = 0; step <= o.profile_steps; ++step) {
      if (step == 1) probe.profile().reset();  // step 0 records the unit order (and runs without prefetch)
      const batch b = make_batch(text, false, o.seed, static_cast<std::uint64_t>(step), comm.rank() * local, local, o.model.seq);
      forward_backward(probe, m, acts, b.tokens, b.targets, local);
      if (o.clip > 0) fsdp::clip_grad_norm(probe, o.clip);
      opt.step();
      opt.zero_grad();
    }
    out.trace = probe.step_trace();
  }
  fsdp::host_queue q;
  out.cost = fsdp::schedule::calibrate(comm, q);
  return out;
}

//! Trains on `comm` for o.steps steps with the shard_group type Group (its policies chosen by
//! the caller, their values in `opts`), reporting through `cb`. With o.auto_plan and no plan in
//! `opts`, profiles first (profile_for_plan) and trains with the plan auto_plan makes (Group's
//! BucketPolicy must then be per_unit).
template <class Group>
run_result train_rank(typename Group::comm_type& comm, const run_options& o, typename Group::options opts, const corpus& text,
                      const callbacks<Group>& cb = {}) {
  using T = typename Group::param_type;
  using clock = std::chrono::steady_clock;
  const int ranks = comm.size(), rank = comm.rank();
  if (o.batch % ranks != 0)
    throw fsdp::error(fsdp::errc::invalid_argument, "the global batch (" + std::to_string(o.batch) +
                                                        ") must be a multiple of the number of ranks (" + std::to_string(ranks) + ")");
  if (o.model.dim % o.model.heads != 0)
    throw fsdp::error(fsdp::errc::invalid_argument, "--dim (" + std::to_string(o.model.dim) + ") must be a multiple of --heads (" +
                                                        std::to_string(o.model.heads) + ")");
  const int local = o.batch / ranks;

  // 1. The model, sharded: one unit for the embedding (with the tied head), one per block.
  //    Each rank fills only its shard with the initial values (no full copy anywhere).
  model<T> m(o.model);
  const std::size_t numel = m.numel();
  run_result result;
  if (o.auto_plan && !opts.plan) {
    profile_result p = profile_for_plan<Group>(comm, o, opts, m, text);
    opts.plan = o.auto_plan->plan_for(p.trace, p.cost);
    opts.prefetch = {};  // the plan gives the issue points
    result.trace = std::move(p.trace);
    result.cost = std::move(p.cost);
  }
  Group group{comm, {}, opts};
  add_units(group, m);
  group.finalize(initial_values(o));
  fsdp::adamw opt{group, {.lr = o.lr, .weight_decay = 0.0f}};
  if (cb.timeline) group.profile().record_timeline(cb.timeline);
  if (group.plan() && result.trace && result.cost && rank == 0 && cb.on_note) {
    const auto& p = *group.plan();
    const auto sim = fsdp::schedule::simulate(*result.trace, *result.cost, p);
    char line[256];
    std::snprintf(line, sizeof line, "plan %s; predicted step %.1f ms, exposed communication %.1f ms, peak %.2f MiB\n\n",
                  fsdp::schedule::describe_buckets(p).c_str(), sim.step_s * 1e3, sim.exposed_comm_s * 1e3,
                  static_cast<double>(sim.peak_bytes) / (1 << 20));
    cb.on_note(line);
  }

  activations acts;
  result.model_numel = numel;
  std::vector<rank_step> all(static_cast<std::size_t>(ranks));
  fsdp::host_queue stats_queue;
  const auto run_start = clock::now();
  for (int step = 0; step < o.steps; ++step) {
    const auto t0 = clock::now();
    const auto sent_before = group.traffic().total();
    const auto wait_before = group.profile().communication_wait();
    group.device().reset_peak_memory();

    // 2. This rank's slice of the step's global batch; forward and backward through the hooks;
    //    AdamW on the local shards.
    const batch b = make_batch(text, false, o.seed, static_cast<std::uint64_t>(step), rank * local, local, o.model.seq);
    rank_step mine;
    mine.loss = forward_backward(group, m, acts, b.tokens, b.targets, local);
    if (o.clip > 0) fsdp::clip_grad_norm(group, o.clip);
    opt.options().lr = learning_rate(o, step);
    opt.step();
    opt.zero_grad();
    mine.step_s = std::chrono::duration<double>(clock::now() - t0).count();
    mine.start_s = std::chrono::duration<double>(t0 - run_start).count();
    mine.wait_s = std::chrono::duration<double>(group.profile().communication_wait() - wait_before).count();
    mine.peak = group.memory().peak;
    mine.persistent = group.memory().persistent_live;
    mine.sent = group.traffic().total() - sent_before;

    // 3. Validation loss every eval_every steps and after the last: forward passes only.
    if (o.eval_every > 0 && (step % o.eval_every == 0 || step + 1 == o.steps)) {
      double v = 0;
      for (int k = 0; k < o.eval_batches; ++k) {
        const batch vb = make_batch(text, true, o.seed, static_cast<std::uint64_t>(k), rank * local, local, o.model.seq);
        v += forward_only(group, m, acts, vb.tokens, vb.targets, local) / o.eval_batches;
        group.reshard_all();
      }
      mine.val_loss = v;
    }

    // 4. Every rank's figures, through the same communicator.
    comm.all_gather(&mine, all.data(), sizeof(rank_step), fsdp::dtype::u8, stats_queue).wait(comm.timeout());
    result.steps.push_back({step, all});
    if (rank == 0 && cb.on_step) cb.on_step(result.steps.back());
  }
  if (cb.timeline) {
    group.profile().record_timeline(nullptr);
    result.events = cb.timeline->chrome_events();
  }
  if (cb.at_end) cb.at_end(group);
  return result;
}

//! Rank 0 receives every rank's string (other ranks get an empty vector): lengths first, then
//! the strings padded to the longest, through all_gather.
template <class Comm>
std::vector<std::string> gather_strings(Comm& comm, const std::string& mine) {
  const auto n = static_cast<std::size_t>(comm.size());
  fsdp::host_queue q;
  std::uint64_t len = mine.size();
  std::vector<std::uint64_t> lens(n);
  comm.all_gather(&len, lens.data(), sizeof len, fsdp::dtype::u8, q).wait(comm.timeout());
  std::uint64_t longest = 1;
  for (auto l : lens) longest = std::max(longest, l);
  std::string padded = mine;
  padded.resize(longest);
  std::string all(longest * n, '\0');
  comm.all_gather(padded.data(), all.data(), longest, fsdp::dtype::u8, q).wait(comm.timeout());
  std::vector<std::string> out;
  if (comm.rank() == 0)
    for (std::size_t r = 0; r < n; ++r) out.push_back(all.substr(r * longest, lens[r]));
  return out;
}

}  // namespace gpt
