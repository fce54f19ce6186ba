#pragma once
//! \file Planners: turn a step_trace and a cost model into a plan under a per-rank memory limit.
//!
//! greedy_plan (SimpleFSDP's auto-bucketing, adapted to units): walk the units in registration
//! order and decide for each unit u whether it joins the current bucket B (P is the bucket
//! before B). u joins B when
//!   1. B + u fits: the simulated peak of the plan (buckets so far, B + u, the remaining units
//!      one per bucket, prefetch 1) stays under the limit, and B + u runs back to back in both
//!      orders; and
//!   2. either B + u's communication still hides behind the compute before it, as prefetch 1
//!      places it (SimpleFSDP's test): its all-gather within P's forward, its reduction plus
//!      the all-gather prefetched alongside within P's backward, its backward all-gather plus
//!      the reduction issued alongside within the next unit's backward;
//!      or merging exposes less communication than keeping u apart (the latency-bound case,
//!      where nothing hides and each collective saved saves an alpha), estimated over every
//!      compute window of the step: the load a window's link carries beyond its compute is
//!      exposed (see link_exposure), as are the first all-gather of each pass and the last
//!      reduction.
//! The result prefetches 1 bucket ahead with one reduction in flight. If that exceeds the
//! limit, the same buckets without prefetch, then one bucket per unit (prefetch 1, then none)
//! are tried.
//!
//! best_plan: a deterministic search with the simulator as the objective (step time, then peak
//! memory), under the limit.
//!   seeds   FSDP2's per-unit plans (prefetch 0, 1, 2), the greedy plan, uniform buckets of k
//!           units (k = 2 .. units; prefetch 1 or none in each pass) and, for sequential orders
//!           with resharding, dp_partition's buckets: a dynamic programme over bucket boundaries
//!           minimizing link_exposure's estimate under a local memory model, its budget bisected
//!           until the simulator finds the partition under the limit.
//!   descent from FSDP2's plan, the greedy plan, the programme's plans and the best seed in
//!           turn: move to the neighbour that simulates fastest (or as fast with the least
//!           memory) until none is faster or the evaluation budget is spent; keep the best end.
//!           Neighbours: merge two adjacent buckets (also with the merged bucket gathered on
//!           demand), split a bucket at any unit, move a boundary by one unit, issue a bucket's
//!           forward or backward all-gather one position earlier or later, give its reduction
//!           one position more or less to finish.
//! Every plan it returns is under the limit and no slower than greedy_plan or per_unit_prefetch
//! when they fit (they are among its seeds).
//!
//! Nested units (a trace with hook events, trace.hpp): the estimates above (hiding, windows,
//! the programme's memory model) price each unit by its forward_s and backward_s, the unit's
//! total compute, as if the units ran one after another. Whether a plan fits the limit, and
//! in best_plan which plan is faster, is the simulator's word, which replays the events: a
//! bucket held around others is charged in full there.
//!
//! Both throw fsdp::error(errc::invalid_argument) when no plan tried fits the limit, naming the
//! smallest peak achievable (of the plans tried) and the limit. Plans depend only on their inputs, so ranks that plan
//! from the same trace and cost model get the same plan (agree on the trace first: timings
//! differ between ranks).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp::schedule {

//! How much best_plan may search.
struct search_options {
  int max_evaluations = 20000;  //!< simulations of candidate plans, seeds included
};

namespace detail {

inline std::string gib(std::size_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// A plan with its simulated result (no collective records).
struct scored {
  plan p;
  sim_result r;
};

inline sim_result quick_simulate(const checked_trace& t, const cost_model& c, const plan& p) {
  return step_simulator(t, c, p, false).run();
}

// Strictly better: faster (beyond rounding), or as fast with a lower peak.
inline bool better(const sim_result& a, const sim_result& b) {
  const double eps = 1e-12 * std::max(1.0, std::abs(b.step_s));
  if (a.step_s < b.step_s - eps) return true;
  if (a.step_s > b.step_s + eps) return false;
  return a.peak_bytes < b.peak_bytes;
}

// Throws the planners' "nothing fits" error with the smallest peak seen, one bucket per unit
// without prefetch (the leanest plan there is for these buckets) included.
[[noreturn]] inline void throw_nothing_fits(const checked_trace& t, const cost_model& c, std::size_t limit,
                                            std::size_t smallest_seen) {
  const sim_result lean = quick_simulate(t, c, per_unit_prefetch(t, 0, 0));
  const std::size_t smallest = std::min(smallest_seen, lean.peak_bytes);
  throw error(errc::invalid_argument,
              "planner: no plan fits the memory limit of " + std::to_string(limit) + " bytes (" + gib(limit) +
                  ") per rank; the smallest peak achievable is " + std::to_string(smallest) + " bytes (" +
                  gib(smallest) + ", the least of the plans tried, one bucket per unit without prefetch among "
                  "them), of which " + std::to_string(lean.persistent_bytes) +
                  " bytes are shards and optimizer state");
}

// Times of a unit range [first, last] as one bucket, from its exact padded layout.
class range_costs {
 public:
  range_costs(const step_trace& t, const cost_model& c) : t_(t), c_(c) {}

  double all_gather(int first, int last) const {
    if (t_.shard_size <= 1) return 0;
    return c_.all_gather.seconds(all_gather_bytes(shard_numel(first, last), t_.param_elem, t_.shard_size));
  }
  double reduction(int first, int last) const {
    const std::size_t shard = shard_numel(first, last);
    double s = 0;
    if (t_.shard_size > 1) s += c_.reduce_scatter.seconds(reduce_scatter_bytes(shard, t_.reduce_elem, t_.shard_size));
    if (t_.replicas() > 1) s += c_.all_reduce.seconds(all_reduce_bytes(shard, t_.reduce_elem, t_.replicas()));
    return s;
  }
  double forward(int first, int last) const {
    double s = 0;
    for (int u = first; u <= last; ++u) s += t_.units[static_cast<std::size_t>(u)].forward_s;
    return s;
  }
  double backward(int first, int last) const {
    double s = 0;
    for (int u = first; u <= last; ++u) s += t_.units[static_cast<std::size_t>(u)].backward_s;
    return s;
  }

 private:
  std::size_t shard_numel(int first, int last) const {
    std::vector<std::size_t> numels;
    for (int u = first; u <= last; ++u) {
      const auto& v = t_.units[static_cast<std::size_t>(u)].param_numels;
      numels.insert(numels.end(), v.begin(), v.end());
    }
    return flat_layout(numels, t_.shard_size, padding_multiple(t_.world_size)).shard_numel();
  }
  const step_trace& t_;
  const cost_model& c_;
};

// Whether units [first, last] run back to back in both orders (a bucket must).
class contiguity {
 public:
  explicit contiguity(const step_trace& t) : f_(t.units.size()), b_(t.units.size()) {
    for (std::size_t i = 0; i < t.forward_order.size(); ++i) f_[static_cast<std::size_t>(t.forward_order[i])] = static_cast<int>(i);
    for (std::size_t i = 0; i < t.backward_order.size(); ++i) b_[static_cast<std::size_t>(t.backward_order[i])] = static_cast<int>(i);
  }
  bool operator()(int first, int last) const {
    return spans(f_, first, last) && spans(b_, first, last);
  }

 private:
  static bool spans(const std::vector<int>& at, int first, int last) {
    int lo = at[static_cast<std::size_t>(first)], hi = lo;
    for (int u = first + 1; u <= last; ++u) {
      lo = std::min(lo, at[static_cast<std::size_t>(u)]);
      hi = std::max(hi, at[static_cast<std::size_t>(u)]);
    }
    return hi - lo == last - first;
  }
  std::vector<int> f_, b_;
};

struct unit_range {
  int first, last;
};

inline double over(double load, double window) { return std::max(0.0, load - window); }

// The dynamic programme's largest bucket, in units: it costs units x this^3 steps.
inline constexpr int dp_max_units = 32;

// The exposed communication of a step whose buckets are `xs` (forward order), estimated per
// compute window as prefetch 1 and one reduction in flight lay the collectives out: the
// all-gather of x[i+1] runs during x[i]'s forward; during x[i]'s backward the link carries the
// reduction of x[i+1] (issued as its backward ended) and, when parameters are gathered again,
// the all-gather of x[i-1] (prefetched at x[i]'s pre-hook). What exceeds a window is exposed,
// as are the first forward all-gather, the first backward all-gather and the last reduction.
inline double link_exposure(const std::vector<unit_range>& xs, const range_costs& c, bool regather) {
  const std::size_t m = xs.size();
  auto ag = [&](std::size_t i) { return c.all_gather(xs[i].first, xs[i].last); };
  auto red = [&](std::size_t i) { return c.reduction(xs[i].first, xs[i].last); };
  double e = ag(0) + red(0) + (regather ? ag(m - 1) : 0.0);
  for (std::size_t i = 0; i < m; ++i) {
    if (i + 1 < m) e += over(ag(i + 1), c.forward(xs[i].first, xs[i].last));
    const double load = (i + 1 < m ? red(i + 1) : 0.0) + (regather && i > 0 ? ag(i - 1) : 0.0);
    e += over(load, c.backward(xs[i].first, xs[i].last));
  }
  return e;
}

// SimpleFSDP's test: the communication of bucket xs[k] hides behind the compute before it:
// its all-gather in the forward of xs[k-1]; its reduction (with the all-gather prefetched
// alongside) in the backward of xs[k-1]; its backward all-gather (with the reduction issued
// alongside) in the backward of xs[k+1]. A first or last bucket has no compute before it.
inline bool hides(const std::vector<unit_range>& xs, std::size_t k, const range_costs& c, bool regather) {
  if (k == 0 || (regather && k + 1 >= xs.size())) return false;
  auto ag = [&](std::size_t i) { return c.all_gather(xs[i].first, xs[i].last); };
  auto red = [&](std::size_t i) { return c.reduction(xs[i].first, xs[i].last); };
  const unit_range& p = xs[k - 1];
  if (ag(k) > c.forward(p.first, p.last)) return false;
  if (red(k) + (regather && k >= 2 ? ag(k - 2) : 0.0) > c.backward(p.first, p.last)) return false;
  if (regather) {
    const unit_range& nx = xs[k + 1];
    if (ag(k) + (k + 2 < xs.size() ? red(k + 2) : 0.0) > c.backward(nx.first, nx.last)) return false;
  }
  return true;
}

inline std::vector<int> assignment_from_starts(const std::vector<int>& starts, int units) {
  std::vector<int> a(static_cast<std::size_t>(units));
  int b = -1;
  std::size_t next = 0;
  for (int u = 0; u < units; ++u) {
    if (next < starts.size() && starts[next] == u) {
      ++b;
      ++next;
    }
    a[static_cast<std::size_t>(u)] = b;
  }
  return a;
}

}  // namespace detail

//! SimpleFSDP-style greedy bucketing under `memory_limit` bytes per rank (algorithm in the
//! file comment). Throws fsdp::error(errc::invalid_argument) on bad input or when no plan fits.
inline plan greedy_plan(const checked_trace& t, const cost_model& c, std::size_t memory_limit) {
  validate(c);
  const int n = t->num_units();
  const detail::range_costs cost(*t, c);
  const detail::contiguity runs_together(*t);
  const bool regather = t->reshard_after_forward;
  std::size_t smallest_seen = std::numeric_limits<std::size_t>::max();

  // Buckets decided so far, then the current one B = [s, u - 1] (the last entry).
  std::vector<detail::unit_range> decided{{0, 0}};
  for (int u = 1; u < n; ++u) {
    const detail::unit_range b = decided.back();
    const detail::unit_range bu{b.first, u};
    bool join = runs_together(b.first, u);
    if (join) {
      // The step as windows: decided buckets, then B and u apart (or B + u), then the rest of
      // the units one per bucket.
      std::vector<detail::unit_range> split(decided.begin(), decided.end()), merged(decided.begin(), decided.end() - 1);
      split.push_back({u, u});
      merged.push_back(bu);
      for (int v = u + 1; v < n; ++v) {
        split.push_back({v, v});
        merged.push_back({v, v});
      }
      const double e_split = detail::link_exposure(split, cost, regather);
      const double e_merged = detail::link_exposure(merged, cost, regather);
      const bool hidden = detail::hides(merged, decided.size() - 1, cost, regather);
      join = hidden || e_merged < e_split - 1e-12 * std::max(1.0, e_split);
    }
    if (join) {  // condition 1: the simulated peak with B + u stays under the limit
      std::vector<int> trial;
      for (std::size_t i = 0; i + 1 < decided.size(); ++i) trial.push_back(decided[i].first);
      trial.push_back(b.first);
      for (int v = u + 1; v < n; ++v) trial.push_back(v);
      const sim_result r = detail::quick_simulate(
          t, c, from_policies(t, detail::assignment_from_starts(trial, n), 1, 1, "greedy"));
      smallest_seen = std::min(smallest_seen, r.peak_bytes);
      join = r.peak_bytes <= memory_limit;
    }
    if (join) decided.back() = bu;
    else decided.push_back({u, u});
  }
  std::vector<int> starts;
  for (const auto& r : decided) starts.push_back(r.first);
  const std::vector<int> buckets = detail::assignment_from_starts(starts, n);
  plan fallbacks[] = {from_policies(t, buckets, 1, 1, "greedy"), from_policies(t, buckets, 0, 0, "greedy"),
                      per_unit_prefetch(t, 1, 1), per_unit_prefetch(t, 0, 0)};
  for (plan& p : fallbacks) {
    const sim_result r = detail::quick_simulate(t, c, p);
    smallest_seen = std::min(smallest_seen, r.peak_bytes);
    if (r.peak_bytes <= memory_limit) {
      p.name = "greedy";
      return p;
    }
  }
  detail::throw_nothing_fits(t, c, memory_limit, smallest_seen);
}

namespace detail {

// The search state: bucket starts and, per bucket, how far ahead its all-gathers are issued
// (positions before its own) and how many positions its reduction may take.
struct search_state {
  std::vector<int> starts;
  std::vector<int> forward_ahead, backward_ahead, reduce_lag;
  friend bool operator==(const search_state&, const search_state&) = default;
};

class local_search {
 public:
  local_search(const checked_trace& t, const cost_model& c, std::size_t limit, int budget)
      : t_(t), c_(c), limit_(limit), budget_(budget), runs_together_(*t) {}

  // Scores a plan; remembers the smallest peak seen. nullopt when it does not fit.
  std::optional<sim_result> score(const plan& p) {
    ++evaluations_;
    const sim_result r = quick_simulate(t_, c_, p);
    smallest_seen_ = std::min(smallest_seen_, r.peak_bytes);
    if (r.peak_bytes > limit_) return std::nullopt;
    return r;
  }
  bool budget_left() const { return evaluations_ < budget_; }
  std::size_t smallest_seen() const { return smallest_seen_; }

  search_state state_of(const plan& p) const {
    const bucket_positions pos = positions_of(t_, p.bucket_of_unit);
    search_state s;
    for (std::size_t u = 0; u < p.bucket_of_unit.size(); ++u)
      if (u == 0 || p.bucket_of_unit[u] != p.bucket_of_unit[u - 1]) s.starts.push_back(static_cast<int>(u));
    for (std::size_t b = 0; b < s.starts.size(); ++b) {
      s.forward_ahead.push_back(pos.forward_pos[b] - p.forward_issue[b]);
      s.backward_ahead.push_back(pos.backward_pos[b] - p.backward_issue[b]);
      s.reduce_lag.push_back(p.reduce_wait[b] - pos.backward_pos[b]);
    }
    return s;
  }

  plan plan_of(const search_state& s) const {
    plan p;
    p.name = "best";
    p.bucket_of_unit = assignment_from_starts(s.starts, t_->num_units());
    const bucket_positions pos = positions_of(t_, p.bucket_of_unit);
    const int k = static_cast<int>(s.starts.size());
    for (std::size_t b = 0; b < s.starts.size(); ++b) {
      p.forward_issue.push_back(std::max(0, pos.forward_pos[b] - s.forward_ahead[b]));
      p.backward_issue.push_back(std::max(0, pos.backward_pos[b] - s.backward_ahead[b]));
      p.reduce_wait.push_back(std::min(k, pos.backward_pos[b] + std::max(1, s.reduce_lag[b])));
    }
    return p;
  }

  // Every neighbour of `s` (see the file comment), in a fixed order.
  std::vector<search_state> neighbours(const search_state& s) const {
    std::vector<search_state> out;
    const int n = t_->num_units();
    const int k = static_cast<int>(s.starts.size());
    auto last_of = [&](int b) { return b + 1 < k ? s.starts[static_cast<std::size_t>(b + 1)] - 1 : n - 1; };
    auto erase_at = [](std::vector<int>& v, int i) { v.erase(v.begin() + i); };
    auto insert_at = [](std::vector<int>& v, int i, int x) { v.insert(v.begin() + i, x); };
    for (int b = 0; b + 1 < k; ++b) {  // merge b and b + 1
      if (!runs_together_(s.starts[static_cast<std::size_t>(b)], last_of(b + 1))) continue;
      search_state m = s;
      const auto i = static_cast<std::size_t>(b);
      m.forward_ahead[i] = std::min(s.forward_ahead[i], s.forward_ahead[i + 1]);
      m.backward_ahead[i] = std::min(s.backward_ahead[i], s.backward_ahead[i + 1]);
      m.reduce_lag[i] = std::min(s.reduce_lag[i], s.reduce_lag[i + 1]);
      erase_at(m.starts, b + 1);
      erase_at(m.forward_ahead, b + 1);
      erase_at(m.backward_ahead, b + 1);
      erase_at(m.reduce_lag, b + 1);
      out.push_back(m);
      // The merged bucket is bigger: the same merge, gathering it on demand, may be what fits.
      m.forward_ahead[i] = 0;
      m.backward_ahead[i] = 0;
      out.push_back(std::move(m));
    }
    for (int b = 0; b < k; ++b) {  // split b before unit v
      const auto i = static_cast<std::size_t>(b);
      for (int v = s.starts[i] + 1; v <= last_of(b); ++v) {
        if (!runs_together_(s.starts[i], v - 1) || !runs_together_(v, last_of(b))) continue;
        search_state m = s;
        insert_at(m.starts, b + 1, v);
        insert_at(m.forward_ahead, b + 1, s.forward_ahead[i]);
        insert_at(m.backward_ahead, b + 1, s.backward_ahead[i]);
        insert_at(m.reduce_lag, b + 1, s.reduce_lag[i]);
        out.push_back(std::move(m));
      }
    }
    for (int b = 1; b < k; ++b) {  // move the boundary before bucket b by one unit
      for (int d : {-1, 1}) {
        const int v = s.starts[static_cast<std::size_t>(b)] + d;
        if (v <= s.starts[static_cast<std::size_t>(b - 1)] || v > last_of(b)) continue;
        if (!runs_together_(s.starts[static_cast<std::size_t>(b - 1)], v - 1) || !runs_together_(v, last_of(b))) continue;
        search_state m = s;
        m.starts[static_cast<std::size_t>(b)] = v;
        out.push_back(std::move(m));
      }
    }
    const bucket_positions pos = positions_of(t_, assignment_from_starts(s.starts, n));
    for (int b = 0; b < k; ++b) {  // issue points and reduction lag, within their ranges
      const auto i = static_cast<std::size_t>(b);
      for (int d : {1, -1}) {
        auto with = [&](std::vector<int> search_state::*field, int lo, int hi) {
          const int v = (s.*field)[i] + d;
          if (v < lo || v > hi) return;
          search_state m = s;
          (m.*field)[i] = v;
          out.push_back(std::move(m));
        };
        with(&search_state::forward_ahead, 0, pos.forward_pos[i]);
        if (t_->reshard_after_forward) with(&search_state::backward_ahead, 0, pos.backward_pos[i]);
        with(&search_state::reduce_lag, 1, k - pos.backward_pos[i]);
      }
    }
    return out;
  }

 private:
  const checked_trace& t_;
  const cost_model& c_;
  std::size_t limit_;
  int budget_;
  int evaluations_ = 0;
  std::size_t smallest_seen_ = std::numeric_limits<std::size_t>::max();
  contiguity runs_together_;
};

// Bucket boundaries by dynamic programming over the window model of link_exposure (prefetch 1,
// one reduction in flight), under a local memory model: forward, buckets i and i+1 gathered;
// backward, i gathered while i+1's reduction is issued (its gradient, reduce-dtype copy and
// output shard), then at i's pre-hook i-1 and i gathered, i's gradient and what i+1's
// reduction still holds (the simulator's release points). Both the
// exposure of window i and the backward memory at i depend on buckets i-1, i and i+1, so a
// state is the last two buckets; buckets hold at most `max_units` units. Returns the bucket
// starts of the cheapest partition whose windows fit `transient_budget` bytes (empty: none).
// Only for sequential orders and parameters resharded after forward (with grad_op every bucket
// stays gathered, and memory is not local).
inline std::vector<int> dp_partition(const step_trace& t, const cost_model& c, std::size_t transient_budget,
                                     int max_units) {
  const int n = t.num_units();
  const int cap = std::max(1, std::min(n, max_units));
  const range_costs cost(t, c);
  const auto pad = padding_multiple(t.world_size);
  struct range_info {
    double ag = 0, red = 0, cf = 0, cb = 0;
    double gathered = 0, grad = 0, copy_and_out = 0, in_flight = 0;  // bytes
  };
  // info[a * (cap + 1) + len]: the range [a, a + len).
  std::vector<range_info> info(static_cast<std::size_t>(n) * static_cast<std::size_t>(cap + 1));
  for (int a = 0; a < n; ++a) {
    std::vector<std::size_t> numels;
    double cf = 0, cb = 0;
    for (int len = 1; len <= cap && a + len <= n; ++len) {
      const auto& u = t.units[static_cast<std::size_t>(a + len - 1)];
      numels.insert(numels.end(), u.param_numels.begin(), u.param_numels.end());
      cf += u.forward_s;
      cb += u.backward_s;
      const flat_layout l(numels, t.shard_size, pad);
      range_info& r = info[static_cast<std::size_t>(a) * static_cast<std::size_t>(cap + 1) + static_cast<std::size_t>(len)];
      const double padded = static_cast<double>(l.padded_numel()), shard = static_cast<double>(l.shard_numel());
      r.ag = t.shard_size > 1 ? c.all_gather.seconds(all_gather_bytes(l.shard_numel(), t.param_elem, t.shard_size)) : 0;
      r.red = cost.reduction(a, a + len - 1);
      r.cf = cf;
      r.cb = cb;
      r.gathered = t.aliased() ? 0 : padded * static_cast<double>(t.param_elem);
      r.grad = padded * static_cast<double>(t.param_elem);
      // A reduction in flight holds its reduce-dtype copy and output shard; the gradient buffer
      // itself only until the cast (other dtype) or the reduce-scatter's end (same dtype).
      const bool cast = t.reduce_elem != t.param_elem;
      const double out = t.shard_size > 1 ? shard * static_cast<double>(t.reduce_elem) : 0;
      r.copy_and_out = (cast ? padded * static_cast<double>(t.reduce_elem) : 0) + out;
      r.in_flight = (cast ? 0 : r.grad) + r.copy_and_out;
    }
  }
  auto at = [&](int a, int len) -> const range_info& {
    return info[static_cast<std::size_t>(a) * static_cast<std::size_t>(cap + 1) + static_cast<std::size_t>(len)];
  };
  const bool regather = t.reshard_after_forward;
  const double budget = static_cast<double>(transient_budget);
  const double inf = std::numeric_limits<double>::infinity();
  // dp[(end, prev_len, len)]: least exposure of buckets covering [0, end), the last two of
  // lengths prev_len (0: none) and len. parent: the previous state's prev_len.
  const std::size_t w = static_cast<std::size_t>(cap + 1);
  auto idx = [&](int end, int pl, int l) {
    return (static_cast<std::size_t>(end) * w + static_cast<std::size_t>(pl)) * w + static_cast<std::size_t>(l);
  };
  std::vector<double> dp(static_cast<std::size_t>(n + 1) * w * w, inf);
  std::vector<int> parent(dp.size(), -1);
  for (int len = 1; len <= cap; ++len) {
    const range_info& x = at(0, len);
    if (x.gathered > budget) break;
    dp[idx(len, 0, len)] = x.ag + x.red;  // the first all-gather and the last reduction are exposed
  }
  for (int end = 1; end < n; ++end)
    for (int pl = 0; pl <= cap; ++pl)
      for (int l = 1; l <= cap && l <= end; ++l) {
        const double base = dp[idx(end, pl, l)];
        if (base == inf) continue;
        const range_info& x = at(end - l, l);
        const range_info* prev = pl > 0 ? &at(end - l - pl, pl) : nullptr;
        for (int nl = 1; nl <= cap && end + nl <= n; ++nl) {
          const range_info& y = at(end, nl);
          if (x.gathered + y.gathered > budget) break;  // forward: x in use, y prefetched
          // Backward, as y's reduction is issued (x prefetched), then at x's pre-hook (x's
          // gradient, x - 1 prefetched, y's reduction in flight). Both grow with nl.
          if (x.gathered + y.grad + y.copy_and_out > budget) break;
          if ((prev ? prev->gathered : 0) + x.gathered + x.grad + y.in_flight > budget) break;
          const double load = y.red + (regather && prev ? prev->ag : 0);
          const double v = base + over(y.ag, x.cf) + over(load, x.cb);
          double& d = dp[idx(end + nl, l, nl)];
          if (v < d) {
            d = v;
            parent[idx(end + nl, l, nl)] = pl;
          }
        }
      }
  double best = inf;
  int best_pl = -1, best_l = -1;
  for (int pl = 0; pl <= cap; ++pl)
    for (int l = 1; l <= cap && l <= n; ++l) {
      const double base = dp[idx(n, pl, l)];
      if (base == inf) continue;
      const range_info& x = at(n - l, l);
      const range_info* prev = pl > 0 ? &at(n - l - pl, pl) : nullptr;
      if ((prev ? prev->gathered : 0) + x.gathered + x.grad > budget) continue;
      const double v = base + (regather ? x.ag : 0) + over(regather && prev ? prev->ag : 0, x.cb);
      if (v < best) {
        best = v;
        best_pl = pl;
        best_l = l;
      }
    }
  std::vector<int> starts;
  if (best_l < 0) return starts;
  int end = n, pl = best_pl, l = best_l;
  while (end > 0) {
    starts.push_back(end - l);
    const int ppl = parent[idx(end, pl, l)];
    end -= l;
    l = pl;
    pl = ppl < 0 ? 0 : ppl;
  }
  std::reverse(starts.begin(), starts.end());
  return starts;
}

}  // namespace detail

//! The fastest plan the search finds under `memory_limit` bytes per rank (algorithm in the
//! file comment); never slower than greedy_plan or per_unit_prefetch when they fit. Throws
//! fsdp::error(errc::invalid_argument) on bad input or when no plan fits.
inline plan best_plan(const checked_trace& t, const cost_model& c, std::size_t memory_limit,
                      const search_options& opts = {}) {
  validate(c);
  const int n = t->num_units();
  detail::local_search search(t, c, memory_limit, std::max(1, opts.max_evaluations));

  std::vector<plan> seeds{per_unit_prefetch(t, 1, 1), per_unit_prefetch(t, 0, 0), per_unit_prefetch(t, 2, 2)};
  try {
    seeds.push_back(greedy_plan(t, c, memory_limit));
  } catch (const error&) {
    // None of greedy's plans fits, one bucket per unit without prefetch among them: then no
    // seed will, and the error below says so.
  }
  const detail::contiguity runs_together(*t);
  for (int size = 2; size <= n; ++size) {  // uniform buckets of `size` units, where they run together
    std::vector<int> starts;
    bool ok = true;
    for (int s = 0; s < n && ok; s += size) {
      starts.push_back(s);
      ok = runs_together(s, std::min(n, s + size) - 1);
    }
    if (!ok) continue;
    // Bigger buckets may fit only with less prefetch: each with prefetch 1 or none per pass.
    const std::vector<int> a = detail::assignment_from_starts(starts, n);
    for (auto [f, b] : {std::pair{1, 1}, std::pair{1, 0}, std::pair{0, 1}, std::pair{0, 0}})
      seeds.push_back(from_policies(t, a, f, b, "uniform"));
  }
  // The dynamic programme's partitions, for sequential orders with resharding.
  bool sequential = t->reshard_after_forward;
  for (int u = 0; u < n && sequential; ++u)
    sequential = t->forward_order[static_cast<std::size_t>(u)] == u && t->backward_order[static_cast<std::size_t>(u)] == n - 1 - u;
  if (sequential) {
    // Bisect the transient budget for the largest whose partition the simulator finds under
    // the limit (the model is local and approximate in both directions); every partition that
    // fits is a seed.
    const std::size_t persistent = detail::quick_simulate(t, c, seeds.front()).persistent_bytes;
    const double room = memory_limit > persistent ? static_cast<double>(memory_limit - persistent) : 0;
    const double cap = std::min(2 * room, static_cast<double>(std::numeric_limits<std::size_t>::max() / 2));
    double lo = 0, hi = cap;
    for (int step = 0; step < 10 && room > 0; ++step) {
      const double budget = step == 0 ? room : 0.5 * (lo + hi);
      const std::vector<int> starts = detail::dp_partition(*t, c, static_cast<std::size_t>(budget), detail::dp_max_units);
      bool fits = false;
      if (!starts.empty()) {
        plan p = from_policies(t, detail::assignment_from_starts(starts, n), 1, 1, "dp");
        fits = detail::quick_simulate(t, c, p).peak_bytes <= memory_limit;
        if (fits) seeds.push_back(std::move(p));
      }
      (fits ? lo : hi) = budget;
    }
  }

  // Score the seeds; descend from FSDP2's plan, the greedy plan, the programme's plans and the
  // best seed (the search is local, and where it ends depends on where it starts).
  std::vector<detail::scored> starts;
  std::optional<detail::scored> best;
  for (std::size_t i = 0; i < seeds.size(); ++i) {
    const auto r = search.score(seeds[i]);
    if (!r) continue;
    const detail::scored here{seeds[i], *r};
    const bool distinct = std::none_of(starts.begin(), starts.end(), [&](const detail::scored& x) { return x.p == seeds[i]; });
    if ((i == 0 || seeds[i].name == "greedy" || seeds[i].name == "dp") && distinct) starts.push_back(here);
    if (!best || detail::better(*r, best->r)) best = here;
  }
  if (!best) detail::throw_nothing_fits(t, c, memory_limit, search.smallest_seen());
  if (std::none_of(starts.begin(), starts.end(), [&](const detail::scored& x) { return x.p == best->p; }))
    starts.push_back(*best);

  for (const detail::scored& start : starts) {
    // Steepest descent: the best neighbour each round. (Taking the first improving neighbour
    // instead spends memory on small gains early and strands the search.)
    detail::scored here = start;
    while (search.budget_left()) {
      std::optional<detail::scored> step;
      for (const auto& m : search.neighbours(search.state_of(here.p))) {
        if (!search.budget_left()) break;
        plan p = search.plan_of(m);
        const auto r = search.score(p);
        if (r && detail::better(*r, step ? step->r : here.r)) step = detail::scored{std::move(p), *r};
      }
      if (!step) break;  // a local optimum
      here = std::move(*step);
    }
    if (detail::better(here.r, best->r)) best = std::move(here);
  }
  best->p.name = "best";
  return best->p;
}

}  // namespace fsdp::schedule
