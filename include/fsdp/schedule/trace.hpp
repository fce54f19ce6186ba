#pragma once
//! \file step_trace: what the planner and the simulator know about one training step. Each
//! unit's parameter sizes and compute times, the order units ran in (forward and backward), the
//! hooks in call order with the compute between them, the world and shard group sizes, the
//! dtype sizes and the optimizer. shard_group's profiling steps fill one (step_trace()); a paper
//! plan builds one from a model's shapes and a FLOP count (bench/plans.cpp).
//!
//!   fsdp::schedule::step_trace t;
//!   t.units = {{"embed", {1024 * 64}, 1e-3, 2e-3}, {"block0", {64 * 64, 64}, 4e-3, 8e-3}};
//!   fsdp::schedule::use_registration_order(t);   // forward 0, 1; backward 1, 0
//!   t.world_size = t.shard_size = 8;
//!   fsdp::schedule::validate(t);                  // throws fsdp::error naming the problem
//!
//! Events. A unit may stay in use around others: GPT's unit 0 (embedding and tied head) runs
//! pre_forward(0), the embedding, units 1..L each pre/compute/post, the head, post_forward(0).
//! forward_events and backward_events list the hooks of each pass in call order, each with the
//! compute before it, so that the simulator knows when a bucket is gathered, freed and reduced
//! and where compute runs. Empty lists mean the plain sequence, derived from the orders and the
//! unit times: pre u, forward_s of u, post u for each u of forward_order (derive_events() writes
//! it out). A pass with events:
//!
//!   // forward of a GPT of 3 blocks: 1 s embedding, 3 s per block, 2 s head
//!   t.forward_events = {{0, true, 0}, {1, true, 1}, {1, false, 3}, {2, true, 0}, {2, false, 3},
//!                       {3, true, 0}, {3, false, 3}, {0, false, 2}};
//!
//! Bucket sizes are never restated here: bucket_layouts() builds the same fsdp::flat_layout,
//! padded to padding_multiple(world_size), that shard_group builds.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/layout.hpp"

namespace fsdp::schedule {

//! One unit (a group of parameters used together) as profiled: its parameter sizes in
//! registration order and the compute time of its forward and of its backward, in seconds.
struct unit_profile {
  std::string name;
  std::vector<std::size_t> param_numels;
  double forward_s = 0;
  double backward_s = 0;
  friend bool operator==(const unit_profile&, const unit_profile&) = default;
};

//! One hook call of a pass: pre_forward / pre_backward of `unit` (pre) or its post hook.
//! compute_s is the time the calling thread computed (outside fsdp's hooks) since the previous
//! hook of the pass returned, or, for a pass's first event, since the pass began: the forward
//! begins with the step (the time before the step's first hook belongs to the previous step's
//! optimizer_s, so a recorded trace has 0 there), the backward when the forward's last hook
//! returned, so backward_events[0].compute_s is the loss.
struct hook_event {
  int unit = 0;
  bool pre = true;       //!< true: pre_forward / pre_backward; false: post_forward / post_backward
  double compute_s = 0;  //!< seconds of compute before this hook (finite, >= 0)
  friend bool operator==(const hook_event&, const hook_event&) = default;
};

//! One training step as the hooks see it, per rank (every rank runs the same step).
struct step_trace {
  std::vector<unit_profile> units;  //!< in registration order (unit index = position here)
  std::vector<int> forward_order;   //!< unit indices in the order of their forward pre hooks
  std::vector<int> backward_order;  //!< unit indices in the order of their backward pre hooks
  //! The forward's hooks in call order (see hook_event); their pres follow forward_order. Empty:
  //! pre u, forward_s, post u for each u of forward_order (derive_events()).
  std::vector<hook_event> forward_events;
  //! The backward's hooks in call order; their pres follow backward_order. Empty: pre u,
  //! backward_s, post u for each u of backward_order.
  std::vector<hook_event> backward_events;
  double backward_tail_s = 0;       //!< compute after the backward's last hook, until finish_backward
  int world_size = 1;               //!< W: ranks of the communicator
  int shard_size = 1;               //!< S: ranks sharing one copy (full_shard: W; no_shard: 1)
  bool reshard_after_forward = true;  //!< false: grad_op (ZeRO-2), kept from forward to backward
  std::size_t param_elem = 4;       //!< bytes per element of the gathered parameters
  std::size_t reduce_elem = 4;      //!< bytes per element of the gradient reduction
  std::size_t master_elem = 4;      //!< bytes per element of the master shard and grad shard
  int optimizer_states = 2;         //!< master-sized shards of optimizer state (AdamW: 2, SGD: 0 or 1)
  //! A persistent param_elem copy of each shard (shard_group's options::keep_low_precision_shard).
  bool low_precision_shard = false;
  double optimizer_s = 0;           //!< compute time of the optimizer step, seconds

  int num_units() const noexcept { return static_cast<int>(units.size()); }
  //! R = W / S: copies of the parameters (all-reduce group size).
  int replicas() const noexcept { return shard_size > 0 ? world_size / shard_size : 0; }
  //! With S == 1 and equal param and master dtypes, shard_group binds the handles to the master
  //! copy: no gathered buffer and no all-gather. (Equal sizes stand for equal dtypes here.)
  bool aliased() const noexcept { return shard_size == 1 && param_elem == master_elem; }
  friend bool operator==(const step_trace&, const step_trace&) = default;
};

//! Sets forward_order to the registration order and backward_order to its reverse, which is
//! what a sequential model runs.
inline step_trace& use_registration_order(step_trace& t) {
  const int n = t.num_units();
  t.forward_order.resize(static_cast<std::size_t>(n));
  t.backward_order.resize(static_cast<std::size_t>(n));
  for (int u = 0; u < n; ++u) {
    t.forward_order[static_cast<std::size_t>(u)] = u;
    t.backward_order[static_cast<std::size_t>(u)] = n - 1 - u;
  }
  return t;
}

namespace detail {

// The plain sequence of a pass: pre u, the unit's compute, post u, for each u of `order`.
inline std::vector<hook_event> sequential_events(const step_trace& t, bool forward) {
  const std::vector<int>& order = forward ? t.forward_order : t.backward_order;
  std::vector<hook_event> out;
  out.reserve(2 * order.size());
  for (int u : order) {
    const unit_profile& p = t.units[static_cast<std::size_t>(u)];
    out.push_back({u, true, 0});
    out.push_back({u, false, forward ? p.forward_s : p.backward_s});
  }
  return out;
}

// Calls of validate(const step_trace&) on this thread (a test counts them: checked once).
inline thread_local long trace_validations = 0;

inline bool finite_nonnegative(double v) noexcept { return std::isfinite(v) && v >= 0; }

// `order` must name every unit exactly once.
inline void check_permutation(const std::vector<int>& order, int n, const char* which) {
  if (static_cast<int>(order.size()) != n)
    throw error(errc::invalid_argument, std::string("step_trace: ") + which + " order has " +
                                            std::to_string(order.size()) + " entries for " + std::to_string(n) +
                                            " units (it must name every unit once)");
  std::vector<bool> seen(static_cast<std::size_t>(n), false);
  for (std::size_t i = 0; i < order.size(); ++i) {
    const int u = order[i];
    if (u < 0 || u >= n)
      throw error(errc::invalid_argument, std::string("step_trace: ") + which + " order entry " + std::to_string(i) +
                                              " names unit " + std::to_string(u) + ", which does not exist (" +
                                              std::to_string(n) + " units)");
    if (seen[static_cast<std::size_t>(u)])
      throw error(errc::invalid_argument, std::string("step_trace: ") + which + " order is not a permutation: unit " +
                                              std::to_string(u) + " appears twice");
    seen[static_cast<std::size_t>(u)] = true;
  }
}

// The events of one pass: units in range, compute finite and >= 0, each unit's pre once and
// matched by its post, hooks properly nested (a post closes the innermost open unit), pres in
// the order of `order` (a permutation of the n units).
inline void check_events(const std::vector<hook_event>& events, const std::vector<int>& order, int n,
                         const char* which) {
  const std::string where = std::string("step_trace: ") + which + " event ";
  const std::string order_name = std::string(which) + "_order";
  std::vector<bool> opened(static_cast<std::size_t>(n), false);
  std::vector<int> open;  // units between their pre and post, innermost last
  std::size_t pres = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const hook_event& e = events[i];
    const std::string at = where + std::to_string(i);
    if (e.unit < 0 || e.unit >= n)
      throw error(errc::invalid_argument, at + " names unit " + std::to_string(e.unit) + ", which does not exist (" +
                                              std::to_string(n) + " units)");
    const std::string hook = std::string(e.pre ? "pre" : "post") + " of unit " + std::to_string(e.unit);
    if (!finite_nonnegative(e.compute_s))
      throw error(errc::invalid_argument, at + " (" + hook + ") has a compute_s that is negative or not finite");
    const auto u = static_cast<std::size_t>(e.unit);
    if (e.pre) {
      if (opened[u])
        throw error(errc::invalid_argument, at + " is a second pre of unit " + std::to_string(e.unit) +
                                                " (each unit runs once per pass, between one pre and one post)");
      if (order[pres] != e.unit)
        throw error(errc::invalid_argument, at + " is the pre of unit " + std::to_string(e.unit) + ", but " +
                                                order_name + " runs unit " + std::to_string(order[pres]) +
                                                " there (the pres must follow " + order_name + ")");
      opened[u] = true;
      ++pres;
      open.push_back(e.unit);
      continue;
    }
    if (open.empty() || std::find(open.begin(), open.end(), e.unit) == open.end())
      throw error(errc::invalid_argument, at + " is the post of unit " + std::to_string(e.unit) +
                                              ", which has no open pre (unbalanced: each post closes its unit's pre)");
    if (open.back() != e.unit)
      throw error(errc::invalid_argument, at + " is the post of unit " + std::to_string(e.unit) + " while unit " +
                                              std::to_string(open.back()) +
                                              ", opened inside it, is still open (mis-nested: close the inner unit first)");
    open.pop_back();
  }
  if (!open.empty())
    throw error(errc::invalid_argument, std::string("step_trace: the ") + which + " events leave unit " +
                                            std::to_string(open.back()) + " open (unbalanced: its pre has no post)");
  if (pres != order.size())
    throw error(errc::invalid_argument, std::string("step_trace: the ") + which + " events hold the pres of " +
                                            std::to_string(pres) + " units, " + order_name + " has " +
                                            std::to_string(order.size()));
}

// A bucket assignment as BucketPolicy::assign returns it: one entry per unit, starting at 0,
// non-decreasing by steps of 0 or 1.
inline void check_assignment(std::span<const int> bucket_of_unit, int units) {
  if (static_cast<int>(bucket_of_unit.size()) != units)
    throw error(errc::invalid_argument, "plan: bucket_of_unit has " + std::to_string(bucket_of_unit.size()) +
                                            " entries for " + std::to_string(units) + " units");
  if (units > 0 && bucket_of_unit[0] != 0)
    throw error(errc::invalid_argument, "plan: bucket_of_unit must start at bucket 0, not " +
                                            std::to_string(bucket_of_unit[0]));
  for (std::size_t u = 1; u < bucket_of_unit.size(); ++u) {
    const int d = bucket_of_unit[u] - bucket_of_unit[u - 1];
    if (d != 0 && d != 1)
      throw error(errc::invalid_argument,
                  "plan: bucket_of_unit must put consecutive units in buckets numbered 0, 1, ... (unit " +
                      std::to_string(u) + " is in bucket " + std::to_string(bucket_of_unit[u]) + " after bucket " +
                      std::to_string(bucket_of_unit[u - 1]) + ")");
  }
}

}  // namespace detail

//! Throws fsdp::error(errc::invalid_argument) naming the first problem: no units, a unit
//! without parameters or with a 0-element parameter, a compute time that is negative or not
//! finite, an order that is not a permutation of the units, events (when given) that name a
//! unit that does not exist, are unbalanced (a pre without its post or a post without its pre),
//! mis-nested (a post while a unit opened inside it is still open), run a unit twice in a pass
//! or whose pres do not follow the pass's order, world or shard size below 1, a shard size that
//! does not divide the world size, a dtype size of 0, a negative optimizer state count.
inline void validate(const step_trace& t) {
  ++detail::trace_validations;
  const std::string where = "step_trace: ";
  if (t.units.empty()) throw error(errc::invalid_argument, where + "no units");
  for (std::size_t u = 0; u < t.units.size(); ++u) {
    const unit_profile& p = t.units[u];
    const std::string name = "unit " + std::to_string(u) + (p.name.empty() ? "" : " ('" + p.name + "')");
    if (p.param_numels.empty()) throw error(errc::invalid_argument, where + name + " has no parameters");
    for (std::size_t i = 0; i < p.param_numels.size(); ++i)
      if (p.param_numels[i] == 0)
        throw error(errc::invalid_argument, where + name + " parameter " + std::to_string(i) + " has 0 elements");
    if (!detail::finite_nonnegative(p.forward_s) || !detail::finite_nonnegative(p.backward_s))
      throw error(errc::invalid_argument, where + name + " has a compute time that is negative or not finite");
  }
  const int n = t.num_units();
  detail::check_permutation(t.forward_order, n, "forward");
  detail::check_permutation(t.backward_order, n, "backward");
  if (!t.forward_events.empty()) detail::check_events(t.forward_events, t.forward_order, n, "forward");
  if (!t.backward_events.empty()) detail::check_events(t.backward_events, t.backward_order, n, "backward");
  if (!detail::finite_nonnegative(t.backward_tail_s))
    throw error(errc::invalid_argument, where + "backward_tail_s is negative or not finite");
  if (t.world_size < 1) throw error(errc::invalid_argument, where + "world_size must be at least 1, got " + std::to_string(t.world_size));
  if (t.shard_size < 1) throw error(errc::invalid_argument, where + "shard_size must be at least 1, got " + std::to_string(t.shard_size));
  if (t.world_size % t.shard_size != 0)
    throw error(errc::invalid_argument, where + "shard_size " + std::to_string(t.shard_size) +
                                            " does not divide world_size " + std::to_string(t.world_size));
  if (t.param_elem == 0 || t.reduce_elem == 0 || t.master_elem == 0)
    throw error(errc::invalid_argument, where + "param_elem, reduce_elem and master_elem must be at least 1 byte");
  if (t.optimizer_states < 0) throw error(errc::invalid_argument, where + "optimizer_states must be >= 0");
  if (!detail::finite_nonnegative(t.optimizer_s))
    throw error(errc::invalid_argument, where + "optimizer_s is negative or not finite");
}

//! A copy of a trace that validate() accepted: only this validating constructor makes one. The
//! schedule API's entry points take one, so a plain step_trace is checked once where it enters,
//! and what they hand on inside is not checked again. Read it through * and ->.
class checked_trace {
 public:
  checked_trace(step_trace t) : t_(std::move(t)) { validate(t_); }  // implicit: the check at the door
  const step_trace& operator*() const noexcept { return t_; }
  const step_trace* operator->() const noexcept { return &t_; }

 private:
  step_trace t_;
};

//! Fills an empty forward_events or backward_events with the plain sequence the simulator
//! assumes for it: pre u (no compute before it), post u after the unit's forward_s
//! (backward_s), for each u of forward_order (backward_order). Lists already given stay.
//! Simulating the result gives exactly what simulating `t` gives.
inline step_trace& derive_events(step_trace& t) {
  if (t.forward_events.empty()) t.forward_events = detail::sequential_events(t, true);
  if (t.backward_events.empty()) t.backward_events = detail::sequential_events(t, false);
  return t;
}

//! Sets each unit's forward_s and backward_s from the events, as shard_group's unit_timings()
//! measures them: the compute before a hook goes to the innermost unit open at that time
//! (compute with no unit open, like a loss between the passes or backward_tail_s, to none). So
//! a unit that stays in use around others gets its own compute only (GPT's unit 0: embedding
//! plus head). Passes without events keep their times. Throws what validate() throws.
inline step_trace& unit_times_from_events(step_trace& t) {
  validate(t);
  auto charge = [&](const std::vector<hook_event>& events, double unit_profile::*field) {
    if (events.empty()) return;
    for (auto& u : t.units) u.*field = 0;
    std::vector<int> open;
    for (const hook_event& e : events) {
      if (!open.empty()) t.units[static_cast<std::size_t>(open.back())].*field += e.compute_s;
      if (e.pre) open.push_back(e.unit);
      else open.pop_back();
    }
  };
  charge(t.forward_events, &unit_profile::forward_s);
  charge(t.backward_events, &unit_profile::backward_s);
  return t;
}

//! The flat layouts of the buckets of `bucket_of_unit` (one entry per unit, as
//! BucketPolicy::assign returns it): exactly the layouts shard_group builds, sharded S ways
//! and padded to padding_multiple(world_size). Throws on an invalid trace or assignment.
inline std::vector<flat_layout> bucket_layouts(const step_trace& t, std::span<const int> bucket_of_unit) {
  detail::check_assignment(bucket_of_unit, t.num_units());
  const std::size_t buckets = bucket_of_unit.empty() ? 0 : static_cast<std::size_t>(bucket_of_unit.back() + 1);
  std::vector<std::vector<std::size_t>> numels(buckets);
  for (std::size_t u = 0; u < t.units.size(); ++u) {
    auto& v = numels[static_cast<std::size_t>(bucket_of_unit[u])];
    v.insert(v.end(), t.units[u].param_numels.begin(), t.units[u].param_numels.end());
  }
  std::vector<flat_layout> out;
  out.reserve(buckets);
  const std::size_t pad = padding_multiple(t.world_size);
  for (auto& v : numels) out.emplace_back(v, t.shard_size, pad);
  return out;
}

//! Sum of the unit's parameter elements (no padding).
inline std::size_t param_numel(const unit_profile& u) noexcept {
  std::size_t n = 0;
  for (std::size_t x : u.param_numels) n += x;
  return n;
}

}  // namespace fsdp::schedule
