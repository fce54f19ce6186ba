#pragma once
//! \file hook_profiler: what a shard_group measures while its hooks run, with one enter() and
//! one leave() per hook call. Host time throughout: on CUDA it measures issue, not kernels.
//!
//! - Unit compute times: the innermost unit between its pre and post hooks is the one
//!   computing, so a unit's time excludes the hooks of units nested inside it (a unit that stays
//!   gathered around others, like a tied embedding/head).
//! - Time blocked on communication (wait()).
//! - The hook sequence of a step with the compute before each hook, summed over steps of the
//!   same shape, and the time between steps (the optimizer): what step_trace() reports.
//! - A timeline (core/timeline.hpp) when one is recorded: compute and waits on the compute lane,
//!   all-gathers and reductions on their queues' lanes.
//! - On a device whose queues run by themselves (CUDA), once time_on_device() started it: the
//!   collectives and compute's waits for them on the device's clock (device_spans.hpp), so that
//!   communication_wait() is the time compute stalled on communication, not the host's.
//!
//! Clock reads cost ~40 ns each (measured with fsdp_bench overhead): one at each end of a hook,
//! none for a wait on an event that is already complete.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/timeline.hpp"
#include "fsdp/detail/group/device_spans.hpp"
#include "fsdp/device/concepts.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp::detail {

class hook_profiler {
 public:
  using clock = timeline::clock;
  enum class hook { pre_forward, post_forward, pre_backward, post_backward };

  //! One unit's compute time summed over the steps since the last reset(), and how many
  //! forward and backward runs that covers.
  struct unit_timing {
    std::chrono::nanoseconds forward{};
    std::chrono::nanoseconds backward{};
    int forward_runs = 0;
    int backward_runs = 0;
  };

  hook_profiler(int rank, std::vector<std::string> unit_names) : rank_(rank), names_(std::move(unit_names)) { reset(); }

  // ---- what a user reads --------------------------------------------------------------------

  //! Per unit, its compute time since the last reset().
  std::span<const unit_timing> unit_timings() const noexcept { return timings_; }
  //! Time the caller spent blocked on communication (waiting for an all-gather, or for an
  //! earlier reduction before issuing the next) since the last reset(). On CUDA the compute
  //! stream waits instead of the host: after time_on_device() this is the compute stream's
  //! stall (the exposed communication) of the waits that have happened on the GPU so far.
  std::chrono::nanoseconds communication_wait() const {
    device_.resolve(comm_wait_, timeline_, rank_);
    return comm_wait_;
  }
  //! Times collectives and waits on `dev`'s clock from now on (see the file comment), anchored
  //! at a mark its idle compute stream reaches at once, read against the host's clock: two host
  //! waits here, none in the steps.
  template <class Device>
  void time_on_device(Device& dev, std::chrono::milliseconds timeout) {
    dev.synchronize(timeout);
    device_mark anchor = dev.compute_mark();
    const clock::time_point host = clock::now();
    dev.synchronize(timeout);
    device_.start(std::move(anchor), host);
  }
  //! Restarts every sum (timings, waits, the step's hook sequence, the time between steps).
  void reset() {
    timings_.assign(names_.size(), unit_timing{});
    comm_wait_ = {};
    between_steps_ = {};
    between_runs_ = 0;
    forward_events_.clear(), backward_events_.clear(), step_forward_.clear(), step_backward_.clear();
    backward_tail_s_ = 0;
    event_steps_ = 0;
  }
  //! Records spans into `t` from now on (nullptr stops). `t` must outlive the group, or
  //! recording must be stopped and the group's finish_backward() called first.
  void record_timeline(timeline* t) noexcept { timeline_ = t; }

  // ---- what the driver calls ----------------------------------------------------------------

  //! A hook of unit u starts.
  void enter(int u, hook h) {
    const auto now = clock::now();
    const bool pre = h == hook::pre_forward || h == hook::pre_backward;
    const bool backward = h == hook::pre_backward || h == hook::post_backward;
    if (h == hook::pre_forward && finished_at_ != clock::time_point{}) {  // the first hook of a step
      between_steps_ += now - finished_at_;
      ++between_runs_;
      finished_at_ = {};
      hook_ended_ = {};
    }
    if (backward && !in_backward_) {
      in_backward_ = true;
      step_backward_.clear();
    }
    const double computed = hook_ended_ == clock::time_point{} ? 0.0 : seconds(now - hook_ended_);
    (backward ? step_backward_ : step_forward_).push_back({u, pre, computed});
    if (pre) {
      if (!active_.empty()) charge(active_.back(), now);  // the unit computing until now stops
    } else {
      end_compute(u, now);
    }
  }
  //! A hook of unit u returns: after a pre hook u computes; after a post hook the enclosing
  //! unit, if any, computes again.
  void leave(int u, hook h) {
    if (h == hook::pre_forward || h == hook::pre_backward) active_.push_back({u, h == hook::pre_forward});
    hook_ended_ = resumed_at_ = clock::now();
  }

  //! Waits through `wait_for()` for `e`, counting the time blocked as communication and, if it
  //! really blocked, adding a "wait <what> <bucket>" span to the timeline. On a device timed by
  //! its own clock, `mark()` gives the compute marks around the wait instead.
  template <class Event, class Wait, class Mark>
  void wait(const Event& e, Wait&& wait_for, Mark&& mark, const char* what, const std::string& bucket) {
    if (device_.on()) {
      device_mark before = mark();
      wait_for();
      device_.add(timeline::lane::compute, std::string("wait ").append(what).append(" ").append(bucket), std::move(before), mark(), true);
      return;
    }
    if (e.ready()) {  // the common, prefetched case: no clock reads
      wait_for();
      return;
    }
    const auto t0 = clock::now();
    wait_for();
    const auto t1 = clock::now();
    comm_wait_ += t1 - t0;
    if (timeline_) timeline_->add(rank_, timeline::lane::compute, std::string("wait ").append(what).append(" ").append(bucket), t0, t1);
  }

  //! A span on a queue's lane covering exactly the work queued between begin_span and
  //! end_span: each enqueues a host task noting the time. Queues without host tasks (CUDA
  //! streams) get none.
  //! On a device timed by its own clock (time_on_device), a queue with marks gets its span
  //! from two marks instead.
  struct span_start {
    std::shared_ptr<clock::time_point> host;
    device_mark device;
  };
  template <class Queue>
  span_start begin_span(Queue& q) {
    if constexpr (host_task_queue<Queue>) {
      if (!timeline_) return {};
      auto t = std::make_shared<clock::time_point>();
      q.enqueue([t] { *t = clock::now(); });
      return {t, {}};
    } else if constexpr (requires { q.mark(); }) {
      if (device_.on()) return {nullptr, q.mark()};
    }
    return {};
  }
  //! The span is named "<what> <bucket>", built only when a timeline records it.
  template <class Queue>
  void end_span(Queue& q, span_start began, timeline::lane lane, const char* what, const std::string& bucket) {
    if constexpr (host_task_queue<Queue>) {
      if (!began.host || !timeline_) return;
      q.enqueue([t = began.host, tl = timeline_, r = rank_, lane, name = std::string(what).append(" ").append(bucket)] {
        tl->add(r, lane, name, *t, clock::now());
      });
    } else if constexpr (requires { q.mark(); }) {
      if (began.device) device_.add(lane, std::string(what).append(" ").append(bucket), std::move(began.device), q.mark(), false);
    }
  }

  //! finish_backward: adds this step's hook sequence to the sums (a step of another shape
  //! restarts them) and starts the time between steps, unless already started.
  void end_step() {
    device_.resolve(comm_wait_, timeline_, rank_);  // what has happened on the device by now
    const double tail = hook_ended_ == clock::time_point{} ? 0.0 : seconds(clock::now() - hook_ended_);
    const auto same_shape = [](const std::vector<schedule::hook_event>& a, const std::vector<schedule::hook_event>& b) {
      return a.size() == b.size() &&
             std::equal(a.begin(), a.end(), b.begin(), [](const auto& x, const auto& y) { return x.unit == y.unit && x.pre == y.pre; });
    };
    if (!step_forward_.empty() && !step_backward_.empty()) {
      if (event_steps_ > 0 && same_shape(forward_events_, step_forward_) && same_shape(backward_events_, step_backward_)) {
        for (std::size_t i = 0; i < forward_events_.size(); ++i) forward_events_[i].compute_s += step_forward_[i].compute_s;
        for (std::size_t i = 0; i < backward_events_.size(); ++i) backward_events_[i].compute_s += step_backward_[i].compute_s;
        backward_tail_s_ += tail;
        ++event_steps_;
      } else {
        forward_events_ = step_forward_;
        backward_events_ = step_backward_;
        backward_tail_s_ = tail;
        event_steps_ = 1;
      }
    }
    step_forward_.clear();
    step_backward_.clear();
    in_backward_ = false;
    hook_ended_ = {};
    // The first finish_backward after a backward starts the time between steps: clipping, the
    // optimizer (whose step() calls finish_backward again) and whatever the engine does next.
    if (finished_at_ == clock::time_point{}) finished_at_ = clock::now();
  }
  //! reshard_all after a forward-only pass: that pass is not a step.
  void end_forward_only_pass() {
    step_forward_.clear();
    hook_ended_ = {};
    if (finished_at_ != clock::time_point{}) finished_at_ = clock::now();
  }

  //! Writes this rank's times into `t` (whose units are in registration order): each unit's
  //! mean compute per run, the step's hook sequence with its mean compute, the backward tail
  //! and the mean time between steps.
  void fill(schedule::step_trace& t) const {
    for (std::size_t u = 0; u < t.units.size(); ++u) {
      const unit_timing& tm = timings_[u];
      const auto mean = [](std::chrono::nanoseconds d, int runs) { return runs > 0 ? seconds(d) / runs : 0.0; };
      t.units[u].forward_s = mean(tm.forward, tm.forward_runs);
      t.units[u].backward_s = mean(tm.backward, tm.backward_runs);
    }
    t.optimizer_s = between_runs_ > 0 ? seconds(between_steps_) / between_runs_ : 0.0;
    if (event_steps_ > 0) {
      t.forward_events = forward_events_;
      t.backward_events = backward_events_;
      for (auto* list : {&t.forward_events, &t.backward_events})
        for (auto& e : *list) e.compute_s /= event_steps_;
      t.backward_tail_s = backward_tail_s_ / event_steps_;
    }
  }
  //! Every time fill() writes, in a fixed order (for averaging them over ranks).
  static std::vector<double*> times_of(schedule::step_trace& t) {
    std::vector<double*> out;
    for (auto& u : t.units) out.push_back(&u.forward_s), out.push_back(&u.backward_s);
    for (auto* list : {&t.forward_events, &t.backward_events})
      for (auto& e : *list) out.push_back(&e.compute_s);
    out.push_back(&t.backward_tail_s);
    out.push_back(&t.optimizer_s);
    return out;
  }

 private:
  struct active_unit {
    int unit;
    bool forward;
  };

  static double seconds(clock::duration d) { return std::chrono::duration<double>(d).count(); }

  // Unit u's post hook starts: its compute ends (an outer unit that ended early adds nothing).
  void end_compute(int u, clock::time_point now) {
    const auto it = std::find_if(active_.rbegin(), active_.rend(), [u](const active_unit& a) { return a.unit == u; });
    if (it == active_.rend()) return;
    if (it == active_.rbegin()) charge(*it, now);
    auto& t = timings_[static_cast<std::size_t>(u)];
    ++(it->forward ? t.forward_runs : t.backward_runs);
    active_.erase(std::next(it).base());
  }
  void charge(const active_unit& a, clock::time_point now) {
    auto& t = timings_[static_cast<std::size_t>(a.unit)];
    (a.forward ? t.forward : t.backward) += now - resumed_at_;
    if (timeline_)
      timeline_->add(rank_, timeline::lane::compute,
                     std::string(a.forward ? "forward " : "backward ").append(names_[static_cast<std::size_t>(a.unit)]), resumed_at_, now);
    resumed_at_ = now;
  }

  int rank_;
  std::vector<std::string> names_;
  timeline* timeline_ = nullptr;
  std::vector<active_unit> active_;  // units between their pre and post hooks, innermost last
  clock::time_point resumed_at_{};
  std::vector<unit_timing> timings_;
  // Mutable: communication_wait() takes in the device's spans that have happened since.
  mutable std::chrono::nanoseconds comm_wait_{};
  mutable device_spans device_;
  clock::time_point finished_at_{};  // end of the last finish_backward, until the next step's first hook
  clock::time_point hook_ended_{};   // when the last hook of this step returned
  bool in_backward_ = false;         // this step's backward has begun
  std::vector<schedule::hook_event> step_forward_, step_backward_;      // this step's hooks
  std::vector<schedule::hook_event> forward_events_, backward_events_;  // summed over event_steps_ steps
  double backward_tail_s_ = 0;
  int event_steps_ = 0;
  std::chrono::nanoseconds between_steps_{};
  int between_runs_ = 0;
};

}  // namespace fsdp::detail
