#pragma once
// gpt/train.hpp: one rank's training run of the GPT model on a shard_group, on any backend.
// train_gpt.cpp (the command-line program), the loss-parity test and the step benchmark use it.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <filesystem>

#include <fsdp/fsdp.hpp>
#include <fsdp/schedule/auto_bucket.hpp>
#include <fsdp/schedule/choose_sharding.hpp>
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
  //! Clip in AdamW's own pass (fsdp::grad_norm, clip_coefficient, step(grad_scale)); false:
  //! clip_grad_norm scales the gradients in a pass of its own first. The same losses bit for bit
  //! (tests/gpt); train_gpt --clip-pass fused|separate, for an A/B on a GPU.
  bool clip_in_optimizer = true;
  std::uint64_t seed = 1;  // initial values and batches
  int eval_every = 25;     // validation loss every k steps (0: never), and after the last
  int eval_batches = 2;    // global batches of validation text per evaluation
  int profile_steps = 3;   // auto_plan: steps timed (after one that records the order) to plan from
  //! When set, and the group's options carry no plan: profile first (profile_for_plan), then
  //! train with the plan this auto_bucket makes from that trace and cost model.
  std::optional<fsdp::auto_bucket> auto_plan{};
  //! When set: profile with full sharding, measure the links inside and across hosts, and train
  //! with the shard size schedule::choose_sharding picks under this per-rank memory limit
  //! (bytes; 0: none), instead of the sharding in the group's options.
  std::optional<std::size_t> auto_sharding{};
  //! Checkpoints (fsdp/checkpoint/sharded.hpp): into save_dir/step_<8 digits>/ every save_every
  //! steps (0: only after the last), written in the background while training goes on with
  //! save_async; resume from a checkpoint, or from the latest complete one of a save_dir
  //! (resume_path), continuing to `steps`. The data position follows from the step and the
  //! seed, which the checkpoint keeps as the engine's bytes (resume_state).
  std::string save_dir;
  int save_every = 0;
  bool save_async = false;
  std::string resume;
  //! After the last step: the full parameters as one safetensors file (fsdp/checkpoint/full.hpp).
  std::string export_path;
  fsdp::dtype export_dtype = fsdp::dtype::f32;
  //! Parameters registered frozen (by name, e.g. "wte"): gathered, never reduced or updated.
  std::vector<std::string> freeze;
  //! Gradient accumulation: each rank's batch in this many micro-batches (dividing it). The
  //! gradients accumulate unsharded and are reduced after the last (FSDP's no_sync); with
  //! reduce_each_micro_batch every micro-batch is reduce-scattered instead (less memory) and a
  //! hybrid sharding all-reduces across replicas after the last only (set_requires_all_reduce).
  int micro_batches = 1;
  bool reduce_each_micro_batch = false;
};

//! The engine's bytes a checkpoint carries: where the data stream is ("step", "seed") and the
//! run's length ("steps", which shapes the learning-rate schedule; 0 in older checkpoints).
struct resume_state {
  long step = 0;
  std::uint64_t seed = 0;
  long steps = 0;
  std::string to_text() const {
    return "step " + std::to_string(step) + " seed " + std::to_string(seed) + " steps " + std::to_string(steps);
  }
  static resume_state from_bytes(const std::vector<std::byte>& b) {
    resume_state r;
    const std::string text(reinterpret_cast<const char*>(b.data()), b.size());
    unsigned long long seed = 0;
    if (std::sscanf(text.c_str(), "step %ld seed %llu steps %ld", &r.step, &seed, &r.steps) < 2)
      throw fsdp::error(fsdp::errc::checkpoint, "--resume: the checkpoint's engine bytes are not train_gpt's ('" + text + "')");
    r.seed = seed;
    return r;
  }
};

//! Where step `step`'s checkpoint goes: DIR/step_00000040.
inline std::filesystem::path checkpoint_path(const std::string& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08d", step);
  return std::filesystem::path(dir) / name;
}

//! --resume PATH: PATH itself when it is a checkpoint, else the latest complete step_*
//! checkpoint inside it.
inline std::filesystem::path resume_path(const std::string& path) {
  if (fsdp::checkpoint::is_complete(path)) return path;
  if (auto latest = fsdp::checkpoint::latest(path)) return *latest;
  throw fsdp::error(fsdp::errc::checkpoint, "--resume " + path + ": neither a checkpoint (no index.json) nor a directory holding "
                                            "a complete step_* checkpoint");
}

//! The learning rate of a step: linear warm-up over o.warmup steps, then a cosine decay from
//! o.lr to o.lr / 10 at the last step (what GPT-2-style training does).
inline float learning_rate(const run_options& o, int step) {
  const double warm = o.warmup > 0 ? std::min(1.0, (step + 1.0) / o.warmup) : 1.0;
  const double progress = o.steps > 1 ? static_cast<double>(step) / (o.steps - 1) : 0.0;
  const double decay = 0.1 + 0.9 * 0.5 * (1.0 + std::cos(3.141592653589793 * progress));
  return static_cast<float>(o.lr * warm * decay);
}

//! Where a rank found the first non-finite value in its shards (gradients or parameters):
//! element `element` of parameter `param` of unit `unit`; unit -1 when every value is finite.
struct nonfinite_at {
  std::int32_t unit = -1;
  std::int32_t param = -1;  // index in the unit's parameter list
  std::uint64_t element = 0;
  double value = 0;
  bool found() const { return unit >= 0; }
  friend bool operator<(const nonfinite_at& a, const nonfinite_at& b) {  // model order; not found last
    if (a.found() != b.found()) return a.found();
    if (a.unit != b.unit) return a.unit < b.unit;
    if (a.param != b.param) return a.param < b.param;
    return a.element < b.element;
  }
};

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
  std::uint64_t sent_inter_host = 0;                        // of which to ranks on other hosts
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // before clipping; NaN when not clipping
  nonfinite_at bad_grad{}, bad_param{};  // looked for when the loss or the gradient norm is not finite
  double param_max_abs = -1;             // the parameters' largest magnitude when looked at; -1 when not
  bool stop = false;                     // rank 0: on_step threw at an earlier step
  std::int32_t stop_signal = 0;          // the signal this rank received (fsdp::stop_signals), 0 when none
};
static_assert(std::is_trivially_copyable_v<rank_step>);

//! Into `mine`, the figures of a step that began at t0 (the run's first at run_start), given the
//! group's traffic and communication wait at t0: train_rank's and the GPU loop's
//! (gpt/cuda/train.cu).
template <class Group, class Wait>
void take_step_figures(rank_step& mine, Group& group, std::chrono::steady_clock::time_point t0,
                       std::chrono::steady_clock::time_point run_start, const fsdp::traffic_counters& sent_before, Wait wait_before) {
  using clock = std::chrono::steady_clock;
  mine.step_s = std::chrono::duration<double>(clock::now() - t0).count();
  mine.start_s = std::chrono::duration<double>(t0 - run_start).count();
  mine.wait_s = std::chrono::duration<double>(group.profile().communication_wait() - wait_before).count();
  mine.peak = group.memory().peak;
  mine.persistent = group.memory().persistent_live;
  const fsdp::traffic_counters sent = group.traffic() - sent_before;
  mine.sent = sent.total();
  mine.sent_inter_host = sent.inter_host;
}

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
  //! Rank 0, after each step. When it throws (a failed write), every rank stops at the next
  //! exchange of figures (the next step's, or one after the last step) and rank 0 rethrows
  //! its exception; the others throw errc::peer_failure. No rank is left waiting in a
  //! collective for rank 0 (which MPI could not end).
  std::function<void(const step_report&)> on_step{};
  std::function<void(const std::string&)> on_note{};  //!< rank 0: the plan auto_plan chose, checkpoints saved and resumed
  fsdp::timeline* timeline = nullptr;                 //!< the group records its spans here
  std::function<void(Group&)> at_end{};               //!< every rank, the group after the last step
  //! Whether run_result::steps keeps every step's report (on every rank). A long run should
  //! say false and take what it needs in on_step: the history grows on every rank by
  //! sizeof(rank_step) (128 bytes) times the number of ranks per step.
  bool keep_steps = true;
};

//! What train_rank throws, on every rank at once, when a step's loss, validation loss or
//! gradient norm is not finite. what(): "step 12: loss is nan (not finite); first non-finite
//! gradient: block0.qkv_w[37] = nan; ...".
struct not_finite : std::runtime_error {
  using std::runtime_error::runtime_error;
};

//! What a run returns on every rank.
struct run_result {
  std::vector<step_report> steps;  // every step's report, unless callbacks::keep_steps is false
  std::size_t model_numel = 0;    // parameters (wte once)
  std::string events;             // this rank's trace events (when a timeline was given)
  std::optional<fsdp::schedule::step_trace> trace;  // auto_plan: what the plan was made from
  std::optional<fsdp::schedule::cost_model> cost;
  //! A stop signal (fsdp::stop_signals) ended the run after step stopped_at - 1, on every rank
  //! together, after a checkpoint when there is a save_dir; 0 when the run went to o.steps.
  int stopped_by = 0;
  int stopped_at = 0;
};

//! Each rank fills only its shard with the model's initial values (no full copy anywhere).
inline auto initial_values(const run_options& o) {
  return fsdp::init::per_shard([o](const fsdp::param_slice& s, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = initial_value(s.name, s.offset + i, o.model, o.seed);
  });
}

//! The first non-finite value of this rank's gradient shards (grads) or master parameter
//! shards, located in the model: bucket entries are the units' parameters in unit order.
//! Reads only local memory (host shards). `max_abs`, when given, receives the largest
//! magnitude of the values looked at.
template <class Group>
nonfinite_at first_nonfinite(Group& g, bool grads, const std::vector<int>& params_per_unit, double* max_abs = nullptr) {
  const int shard_rank = g.rank() % g.shard_size();  // shard groups are consecutive ranks
  for (std::size_t b = 0; b < g.num_buckets(); ++b) {
    const auto s = g.shard(b);
    const auto* v = grads ? s.grads : s.params;
    const fsdp::flat_layout& layout = g.layout(b);
    const std::size_t count = grads ? s.numel : s.numel + s.frozen_numel;  // frozen values follow the trainable ones
    for (std::size_t k = 0; k < count; ++k) {
      const double x = static_cast<double>(v[k]);
      if (std::isfinite(x)) {
        if (max_abs) *max_abs = std::max(*max_abs, std::abs(x));
        continue;
      }
      const std::size_t at = layout.position(shard_rank, k);  // in the bucket's flat buffer
      const auto entry = layout.entry_at(at);
      if (!entry) continue;  // padding
      std::size_t e = *entry;
      const std::uint64_t element = at - layout[e].offset;
      for (int u = 0; u < g.num_units(); ++u) {
        if (g.bucket_of(u) != static_cast<int>(b)) continue;
        const auto n = static_cast<std::size_t>(params_per_unit[static_cast<std::size_t>(u)]);
        if (e < n) return {u, static_cast<std::int32_t>(e), element, x};
        e -= n;
      }
    }
  }
  return {};
}

//! Every parameter's name, by unit and index in the unit (unit 0 the embedding, 1 + l block l).
template <class T>
std::vector<std::vector<std::string>> parameter_names(model<T>& m) {
  std::vector<std::vector<std::string>> out;
  auto add = [&](const std::vector<fsdp::buffer<T>*>& ps) {
    auto& names = out.emplace_back();
    for (const auto* p : ps) names.push_back(p->name());
  };
  add(m.emb().params());
  for (int l = 0; l < m.layers(); ++l) add(m.layer(l).params());
  return out;
}

//! Empty when the step's losses and gradient norm are finite; else what not_finite says: the
//! step, the first figure that is not finite, the first non-finite gradient and parameter in
//! model order (over every rank's shards), and the peak learning rate.
//! `evaluated`: the step has a validation loss; `clipped`: a gradient norm.
inline std::string nonfinite_message(const step_report& s, bool evaluated, bool clipped, double peak_lr,
                                     const std::vector<std::vector<std::string>>& names) {
  const auto g = [](double x) {
    if (std::isnan(x)) return std::string("nan");  // not "-nan": a NaN's sign means nothing
    char b[32];
    std::snprintf(b, sizeof b, "%g", x);
    return std::string(b);
  };
  const std::size_t n = s.ranks.size();
  std::string what;
  auto check = [&](const char* figure, auto get) {
    if (!what.empty()) return;
    std::size_t bad = 0, first = n;
    for (std::size_t r = 0; r < n; ++r)
      if (!std::isfinite(get(s.ranks[r]))) ++bad, first = std::min(first, r);
    if (bad == 0) return;
    what = "step " + std::to_string(s.step) + ": " + figure + " is " + g(get(s.ranks[first])) + " (not finite)";
    if (bad < n) what += " on rank " + std::to_string(first) + (bad > 1 ? " and " + std::to_string(bad - 1) + " more" : "");
  };
  check("loss", [](const rank_step& r) { return r.loss; });
  if (evaluated) check("validation loss", [](const rank_step& r) { return r.val_loss; });
  if (clipped) check("gradient norm", [](const rank_step& r) { return r.grad_norm; });
  for (const auto& r : s.ranks)  // without clipping there is no norm: a non-finite gradient tells
    if (what.empty() && r.bad_grad.found()) what = "step " + std::to_string(s.step) + ": a gradient is not finite";
  if (what.empty()) return what;
  auto first_of = [&](nonfinite_at rank_step::*member) {
    nonfinite_at best;
    for (const auto& r : s.ranks) best = std::min(best, r.*member);
    return best;
  };
  auto describe = [&](const nonfinite_at& at) {
    const auto& unit = names.at(static_cast<std::size_t>(at.unit));
    return unit.at(static_cast<std::size_t>(at.param)) + "[" + std::to_string(at.element) + "] = " + g(at.value);
  };
  const nonfinite_at grad = first_of(&rank_step::bad_grad), param = first_of(&rank_step::bad_param);
  if (grad.found()) what += "; first non-finite gradient: " + describe(grad);
  double max_abs = -1;  // over the ranks that looked
  for (const auto& r : s.ranks) max_abs = std::max(max_abs, r.param_max_abs);
  if (param.found())
    what += "; first non-finite parameter: " + describe(param);
  else if (max_abs >= 0)
    what += "; the parameters are finite, the largest " + g(max_abs) + " in magnitude";
  return what + "; peak learning rate " + g(peak_lr);
}

//! What a plan is made from: the trace of a few profiled steps and the links' cost model.
struct profile_result {
  fsdp::schedule::step_trace trace;
  fsdp::schedule::cost_model cost;
};

//! Times o.profile_steps steps (after one that records the unit order) with a throwaway group
//! of type Group on the same model, AdamW included: the step a plan is made from. Every rank
//! returns the same trace (step_trace() averages the timings over the ranks).
template <class Group>
fsdp::schedule::step_trace record_step(typename Group::comm_type& comm, const run_options& o, const typename Group::options& opts,
                                       model<typename Group::param_type>& m, const corpus& text) {
  const int local = o.batch / comm.size();
  Group probe{comm, {}, opts};
  add_units(probe, m, o.freeze);
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
  return probe.step_trace();
}

//! record_step, and the links measured with schedule::calibrate: what auto_bucket plans from.
//! Every rank returns the same figures.
template <class Group>
profile_result profile_for_plan(typename Group::comm_type& comm, const run_options& o, const typename Group::options& opts,
                                model<typename Group::param_type>& m, const corpus& text) {
  profile_result out;
  out.trace = record_step<Group>(comm, o, opts, m, text);
  fsdp::host_queue q;
  out.cost = fsdp::schedule::calibrate(comm, q);
  return out;
}

//! "sharding auto: ..." and choose_sharding's table: the links it measured, what it chose.
inline std::string describe_choice(const fsdp::schedule::host_links& l, const fsdp::schedule::sharding_choice& c) {
  auto level = [](const char* name, const std::optional<fsdp::schedule::cost_model>& m) {
    if (!m) return std::string();
    char b[160];
    std::snprintf(b, sizeof b, "; %s all-gather %.3g ms + %.4g MB/s", name, m->all_gather.alpha_s * 1e3,
                  m->all_gather.beta_bytes_per_s / 1e6);
    return std::string(b);
  };
  return "sharding auto: " + std::to_string(l.hosts) + " host(s) of " + std::to_string(l.ranks_per_host) + " ranks" +
         level("inside a host", l.intra) + level("across hosts", l.inter) + "; modelled steps:\n" + c.why + "chose " +
         fsdp::to_string(c.sharding) + "\n\n";
}

//! The validation loss: o.eval_batches global batches of validation text (this rank's `local`
//! sequences of each), forward only: gpt::forward_only, or the CUDA model's (gpt/cuda/model.cuh,
//! found by argument-dependent lookup).
template <class Group, class Model, class Activations>
double validation_loss(Group& group, Model& m, Activations& acts, const run_options& o, const corpus& text, int rank, int local) {
  double v = 0;
  for (int k = 0; k < o.eval_batches; ++k) {
    const batch vb = make_batch(text, true, o.seed, static_cast<std::uint64_t>(k), rank * local, local, o.model.seq);
    v += forward_only(group, m, acts, vb.tokens, vb.targets, local) / o.eval_batches;
    group.reshard_all();
  }
  return v;
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
  if (o.micro_batches < 1 || local % o.micro_batches != 0)
    throw fsdp::error(fsdp::errc::invalid_argument, "the micro-batches (" + std::to_string(o.micro_batches) +
                                                        ") must divide each rank's batch (" + std::to_string(local) + " sequences)");
  const int micro = o.micro_batches, rows = local / micro;

  // 1. The model, sharded: one unit for the embedding (with the tied head), one per block.
  //    Each rank fills only its shard with the initial values (no full copy anywhere).
  model<T> m(o.model);
  const std::size_t numel = m.numel();
  run_result result;
  if ((o.auto_sharding || o.auto_plan) && !opts.plan) {
    profile_result p;
    if (o.auto_sharding) {
      // The step is recorded with full sharding; choose_sharding replays it with each shard size.
      opts.sharding = fsdp::full_shard();
      const fsdp::schedule::step_trace trace = record_step<Group>(comm, o, opts, m, text);
      fsdp::host_queue q;
      const fsdp::schedule::host_links links = fsdp::schedule::measure_links(comm, q);
      const fsdp::schedule::sharding_choice choice =
          fsdp::schedule::choose_sharding(trace, links, *o.auto_sharding, opts.prefetch.forward);
      if (rank == 0 && cb.on_note) cb.on_note(describe_choice(links, choice));
      opts.sharding = choice.sharding;
      p = {choice.candidates[choice.chosen].trace, choice.candidates[choice.chosen].cost};
    } else {
      p = profile_for_plan<Group>(comm, o, opts, m, text);
    }
    if (o.auto_plan) {
      opts.plan = o.auto_plan->plan_for(p.trace, p.cost);
      opts.prefetch = {};  // the plan gives the issue points
    }
    result.trace = std::move(p.trace);
    result.cost = std::move(p.cost);
  }
  Group group{comm, {}, opts};
  add_units(group, m, o.freeze);
  group.finalize(initial_values(o));
  fsdp::adamw opt{group, {.lr = o.lr, .weight_decay = 0.0f}};
  int first_step = 0;
  if (!o.resume.empty()) {
    const std::filesystem::path from = resume_path(o.resume);
    const resume_state at = resume_state::from_bytes(fsdp::checkpoint::load(group, from, opt));
    if (at.seed != o.seed)
      throw fsdp::error(fsdp::errc::invalid_argument, "--resume: the checkpoint was trained with --seed " + std::to_string(at.seed) +
                                                          ", this run has --seed " + std::to_string(o.seed) + " (other batches)");
    first_step = static_cast<int>(at.step);
    if (rank == 0 && cb.on_note) cb.on_note("resumed from " + from.string() + " at step " + std::to_string(first_step) + "\n");
    if (rank == 0 && cb.on_note && at.steps > 0 && at.steps != o.steps)
      cb.on_note("warning: the checkpoint's run has --steps " + std::to_string(at.steps) + ", this one --steps " +
                 std::to_string(o.steps) + ": the learning-rate schedule (warm-up, then cosine decay to the last step) " +
                 "follows --steps, so from step " + std::to_string(first_step) + " on the losses are not those of an " +
                 "uninterrupted " + std::to_string(at.steps) + "-step run\n");
    if (first_step >= o.steps)
      throw fsdp::error(fsdp::errc::invalid_argument, "--resume: the checkpoint is at step " + std::to_string(first_step) +
                                                          ", --steps is " + std::to_string(o.steps) + ": nothing left to train");
  }
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
  const std::vector<std::vector<std::string>> names = parameter_names(m);
  std::vector<int> params_per_unit;
  for (const auto& u : names) params_per_unit.push_back(static_cast<int>(u.size()));
  std::vector<rank_step> all(static_cast<std::size_t>(ranks));
  // Each collective on it is waited for at once: the waiting thread runs it, with no hand-off
  // to the queue's thread and back (queue_wake::on_wait).
  fsdp::host_queue stats_queue{"stats", fsdp::queue_wake::on_wait};
  const auto run_start = clock::now();
  std::exception_ptr on_step_failed;  // rank 0
  auto stop_if = [&](bool rank0_failed) {
    if (!rank0_failed) return;
    if (on_step_failed) std::rethrow_exception(on_step_failed);
    throw fsdp::error(fsdp::errc::peer_failure, "rank 0 stopped the run (its on_step failed)", {rank, -1, {}});
  };
  fsdp::checkpoint::async_saver saver;
  std::filesystem::path saving;  // the checkpoint saver writes
  auto saved = [&] {
    if (rank == 0 && cb.on_note) cb.on_note("saved " + saving.string() + "\n");
  };
  for (int step = first_step; step < o.steps; ++step) {
    const auto t0 = clock::now();
    const fsdp::traffic_counters sent_before = group.traffic();
    const auto wait_before = group.profile().communication_wait();
    group.device().reset_peak_memory();

    // 2. This rank's slice of the step's global batch; forward and backward through the hooks;
    //    AdamW on the local shards. Micro-batches: every one but the last either accumulates
    //    unsharded (no sync) or is reduce-scattered and held back from the replicas' all-reduce.
    rank_step mine;
    mine.loss = 0;
    for (int k = 0; k < micro; ++k) {
      const bool last = k + 1 == micro;
      group.set_requires_gradient_sync(last || o.reduce_each_micro_batch);
      group.set_requires_all_reduce(last);
      const batch b = make_batch(text, false, o.seed, static_cast<std::uint64_t>(step), rank * local + k * rows, rows, o.model.seq);
      mine.loss += forward_backward(group, m, acts, b.tokens, b.targets, rows, micro) / micro;
    }
    // Clipping in AdamW's own pass (one pass over the gradients fewer than clip_grad_norm; the
    // gradients stay unscaled, which the search below does not mind).
    float clip_scale = 1.0f;
    if (o.clip > 0 && o.clip_in_optimizer) clip_scale = fsdp::clip_coefficient(mine.grad_norm = fsdp::grad_norm(group), o.clip);
    else if (o.clip > 0) mine.grad_norm = fsdp::clip_grad_norm(group, o.clip);
    // A loss or a gradient norm that is not finite stops the run after this step (below); find
    // the first such gradient and parameter of this rank's shards first. Without clipping
    // there is no norm to tell: look every step (a pass over the local shards).
    if (!std::isfinite(mine.loss) || !(o.clip > 0) || !std::isfinite(mine.grad_norm)) {
      group.finish_backward();
      mine.bad_grad = first_nonfinite(group, true, params_per_unit);
      if (!std::isfinite(mine.loss) || mine.bad_grad.found()) {
        mine.param_max_abs = 0;
        mine.bad_param = first_nonfinite(group, false, params_per_unit, &mine.param_max_abs);
      }
    }
    opt.options().lr = learning_rate(o, step);
    opt.step(clip_scale);
    opt.zero_grad();
    take_step_figures(mine, group, t0, run_start, sent_before, wait_before);

    // 3. Validation loss every eval_every steps and after the last: forward passes only.
    const bool evaluate = o.eval_every > 0 && (step % o.eval_every == 0 || step + 1 == o.steps);
    if (evaluate) {
      const double v = validation_loss(group, m, acts, o, text, rank, local);
      mine.val_loss = v;
      if (!std::isfinite(v)) {  // with the parameters this step's update made
        mine.param_max_abs = 0;
        mine.bad_param = first_nonfinite(group, false, params_per_unit, &mine.param_max_abs);
      }
    }

    // 4. Every rank's figures, through the same communicator.
    //    The same figures on every rank: a step that is not finite stops every rank here.
    mine.stop = on_step_failed != nullptr;
    mine.stop_signal = fsdp::stop_signals::received();
    comm.all_gather(&mine, all.data(), sizeof(rank_step), fsdp::dtype::u8, stats_queue).wait(comm.timeout());
    stop_if(all[0].stop);
    step_report report{step, all};
    if (rank == 0 && cb.on_step) {
      try {
        cb.on_step(report);
      } catch (...) {
        on_step_failed = std::current_exception();
      }
    }
    if (std::string bad = nonfinite_message(report, evaluate, o.clip > 0, o.lr, names); !bad.empty()) throw not_finite(bad);
    if (cb.keep_steps) result.steps.push_back(std::move(report));
    // A stop signal on any rank (preemption): every rank saw it in the figures just exchanged, so
    //    all stop after this step together, with a checkpoint of it.
    int signal = 0;
    for (const rank_step& r : all)
      if (signal == 0) signal = r.stop_signal;
    // 5. A checkpoint after the step (collective). An asynchronous save is committed at the
    //    first step end after every rank has written it.
    if (saver.pending() && saver.commit_if_written(group)) saved();
    if (!o.save_dir.empty() && ((o.save_every > 0 && (step + 1) % o.save_every == 0) || step + 1 == o.steps || signal != 0)) {
      if (saver.pending()) {
        saver.wait();
        saved();
      }
      saving = checkpoint_path(o.save_dir, step + 1);
      const std::string bytes = resume_state{step + 1, o.seed, o.steps}.to_text();
      saver.save(group, saving, opt, std::as_bytes(std::span(bytes)));
      if (!o.save_async || step + 1 == o.steps || signal != 0) {
        saver.wait();
        saved();
      }
    }
    if (signal != 0) {
      if (rank == 0 && cb.on_note)
        cb.on_note("stopped by " + fsdp::stop_signals::name(signal) + " after step " + std::to_string(step) + " (every rank together)" +
                   (o.save_dir.empty() ? "; no --save, nothing kept" : "; resume with --resume " + o.save_dir) + "\n");
      result.stopped_by = signal;
      result.stopped_at = step + 1;
      break;
    }
  }
  if (!o.export_path.empty() && result.stopped_by == 0) {
    fsdp::checkpoint::export_full(group, o.export_path, o.export_dtype);
    if (rank == 0 && cb.on_note) cb.on_note("exported the full parameters to " + o.export_path + "\n");
  }
  {  // rank 0's on_step after the last step: every rank learns whether it failed
    const std::uint8_t failed = on_step_failed ? 1 : 0;
    std::vector<std::uint8_t> failures(static_cast<std::size_t>(ranks));
    comm.all_gather(&failed, failures.data(), 1, fsdp::dtype::u8, stats_queue).wait(comm.timeout());
    stop_if(failures[0] != 0);
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
  fsdp::queue_of<Comm> q{"gather_strings"};  // a host queue, or a GPU stream that stages host memory
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
