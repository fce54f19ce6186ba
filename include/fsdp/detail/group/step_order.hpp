#pragma once
//! \file step_order: the order a shard_group's units run in and the schedule it replays over
//! that order. Pure host code (tests/group/test_step_order.cpp drives it directly).
//!
//! The first forward and backward are recorded (record_forward / record_backward); the driver
//! checks the record across ranks and hands it to follow(). Until then nothing is prefetched
//! and one reduction is in flight. An explicit Prefetch order is followed from finalize on.
//!
//! Following an order means: bucket positions (a bucket's position is the rank of its first
//! unit in the order), the plan replayed over them (the user's, else schedule::prefetch_plan of
//! the Prefetch depths), and from the plan the per-position issue lists (which all-gathers a
//! pre-hook issues after its own) and the reduction waits.

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/policy/prefetch.hpp"
#include "fsdp/schedule/plan.hpp"

namespace fsdp::detail {

class step_order {
 public:
  //! `user_plan`, when given, is replayed instead of the depths of `p`; its lengths and ranges
  //! were checked by check_plan().
  step_order(int rank, prefetch p, std::optional<schedule::plan> user_plan)
      : rank_(rank), prefetch_(std::move(p)), plan_(std::move(user_plan)), user_plan_(plan_.has_value()) {}

  //! Checks a plan given to the group against its units: one bucket per consecutive run, one
  //! issue point and wait per bucket, positions in range, and the unit bytes it was made for.
  static void check_plan(const schedule::plan& p, std::span<const std::size_t> unit_bytes, int rank) {
    const auto k = static_cast<std::size_t>(p.num_buckets());
    const auto bad = [&](const std::string& what) { throw error(errc::invalid_argument, "plan '" + p.name + "': " + what, {rank, -1, {}}); };
    if (p.bucket_of_unit.size() != unit_bytes.size())
      bad("assigns " + std::to_string(p.bucket_of_unit.size()) + " units, the group has " + std::to_string(unit_bytes.size()));
    if (p.forward_issue.size() != k || p.backward_issue.size() != k || p.reduce_wait.size() != k)
      bad("needs one forward_issue, backward_issue and reduce_wait per bucket (" + std::to_string(k) + ")");
    for (std::size_t b = 0; b < k; ++b)
      if (p.forward_issue[b] < 0 || p.backward_issue[b] < 0 || p.reduce_wait[b] < 0 || p.reduce_wait[b] > static_cast<int>(k))
        bad("bucket " + std::to_string(b) + " has a position out of range");
    if (!p.unit_bytes.empty()) {
      if (p.unit_bytes.size() != unit_bytes.size())
        bad("was made for " + std::to_string(p.unit_bytes.size()) + " units, the group has " + std::to_string(unit_bytes.size()));
      for (std::size_t u = 0; u < unit_bytes.size(); ++u)
        if (p.unit_bytes[u] != unit_bytes[u])
          bad("unit " + std::to_string(u) + " has " + std::to_string(unit_bytes[u]) + " parameter bytes, the plan's trace " +
              std::to_string(p.unit_bytes[u]) + " (a trace of another model or dtype?)");
    }
  }

  //! Throws errc::invalid_argument when the explicit Prefetch order names a unit that does not
  //! exist; otherwise, if there is one, follows it from now on.
  void follow_explicit_order(int num_units, const std::vector<int>& bucket_of_unit) {
    const auto check = [&](const std::vector<int>& order, const char* which) {
      for (int u : order)
        if (u < 0 || u >= num_units)
          throw error(errc::invalid_argument, std::string("prefetch ") + which + " order names unit " + std::to_string(u) +
                                                  ", which does not exist", {rank_, -1, {}});
    };
    check(prefetch_.forward_units, "forward");
    check(prefetch_.backward_units, "backward");
    if (prefetch_.forward_units.empty() && prefetch_.backward_units.empty()) return;
    std::vector<int> backward = prefetch_.backward_units;
    if (backward.empty()) backward.assign(prefetch_.forward_units.rbegin(), prefetch_.forward_units.rend());
    follow(prefetch_.forward_units, std::move(backward), bucket_of_unit);
  }

  // ---- recording the first step -------------------------------------------------------------

  void record_forward(int u) {
    if (recording_ && !recorded_backward_.empty()) recording_ = false;  // the first forward-backward is over
    if (recording_) recorded_forward_.push_back(u);
  }
  void record_backward(int u) {
    if (recording_) recorded_backward_.push_back(u);
  }
  //! A forward-only pass (reshard_all) before the first backward is not the step's order.
  void forget_forward_only_pass() {
    if (recording_ && recorded_backward_.empty()) recorded_forward_.clear();
  }
  //! The recorded order has been checked across ranks (once, at the first finish_backward).
  bool recorded_checked() const noexcept { return checked_; }
  //! The record as numbers, for the cross-rank check: forward units, -1, backward units.
  std::vector<int> encode_recorded() const {
    std::vector<int> v(recorded_forward_);
    v.push_back(-1);
    v.insert(v.end(), recorded_backward_.begin(), recorded_backward_.end());
    return v;
  }
  //! "forward [0, 1], backward [1, 0]".
  std::string describe_recorded() const { return "forward " + list(recorded_forward_) + ", backward " + list(recorded_backward_); }
  //! Collective: every rank must have run the same units in the same order in the first step
  //! (throws errc::mismatch otherwise); then recorded_agrees.
  template <class Groups, class Queue>
  void check_recorded_across(Groups& groups, Queue& q, const std::vector<int>& bucket_of_unit) {
    const std::vector<int> recorded = encode_recorded();
    if (groups.agree_across_ranks(std::span<const int>(recorded), q))
      throw error(errc::mismatch, "ranks ran their units in different orders in the first step (this rank: " + describe_recorded() + ")",
                  {rank_, -1, {}});
    recorded_agrees(bucket_of_unit);
  }
  //! Ends recording; unless an explicit order is followed, the record is followed from now on.
  void recorded_agrees(const std::vector<int>& bucket_of_unit) {
    checked_ = true;
    recording_ = false;
    if (!known_) follow(recorded_forward_, recorded_backward_, bucket_of_unit);
  }

  // ---- the schedule followed ----------------------------------------------------------------

  //! Follows these unit orders: bucket positions, the plan over them, issue lists and waits.
  //! Throws errc::invalid_argument when a user plan issues an all-gather after its bucket's
  //! position or waits for a reduction before its bucket's backward ended.
  void follow(std::vector<int> forward_units, std::vector<int> backward_units, const std::vector<int>& bucket_of_unit) {
    forward_units_ = std::move(forward_units);
    backward_units_ = std::move(backward_units);
    const int k = bucket_of_unit.empty() ? 0 : bucket_of_unit.back() + 1;
    positions_of(forward_units_, bucket_of_unit, k, positions_.forward, positions_.forward_pos);
    positions_of(backward_units_, bucket_of_unit, k, positions_.backward, positions_.backward_pos);
    if (!user_plan_) plan_ = schedule::prefetch_plan(positions_, bucket_of_unit, prefetch_.forward, prefetch_.backward);
    forward_issue_at_ = issue_lists(positions_.forward, plan_->forward_issue, "forward");
    backward_issue_at_ = issue_lists(positions_.backward, plan_->backward_issue, "backward");
    for (int b = 0; b < k; ++b) {
      const int pos = positions_.backward_pos[static_cast<std::size_t>(b)];
      const int wait = plan_->reduce_wait[static_cast<std::size_t>(b)];
      if (pos >= 0 && wait <= pos)
        throw error(errc::invalid_argument, "plan: bucket " + std::to_string(b) + "'s reduction must be waited for after its own backward position " +
                                                std::to_string(pos) + ", not at " + std::to_string(wait), {rank_, -1, {}});
    }
    known_ = true;
  }

  //! Whether an order is followed (an explicit one, or the first step's record).
  bool known() const noexcept { return known_; }
  std::span<const int> forward_units() const noexcept { return forward_units_; }
  std::span<const int> backward_units() const noexcept { return backward_units_; }
  const schedule::bucket_positions& positions() const noexcept { return positions_; }
  //! The plan replayed: the user's from the start, else the depths' once the order is known.
  const std::optional<schedule::plan>& plan() const noexcept { return plan_; }

  //! The buckets whose all-gathers bucket b's pre-hook issues after its own (empty while the
  //! order is unknown or when b has no position in that direction).
  std::span<const int> gathers_after(int b, bool backward) const {
    if (!known_) return {};
    const auto& pos = backward ? positions_.backward_pos : positions_.forward_pos;
    const int at = pos[static_cast<std::size_t>(b)];
    if (at < 0) return {};
    return (backward ? backward_issue_at_ : forward_issue_at_)[static_cast<std::size_t>(at)];
  }

  //! How many of the oldest pending reductions (of buckets `pending`, oldest first) must be
  //! complete before bucket b's reduction is issued: those the plan wants done by the end of
  //! b's backward position, and every one before them (they complete in issue order). All of
  //! them while the order is unknown: one reduction in flight.
  //! `pending` is any range, oldest first; `bucket_of(x)` gives an element's bucket (the
  //! driver passes its queue of reductions as it is: no copy on the hook path).
  template <class Pending, class BucketOf>
  std::size_t reductions_due(int b, const Pending& pending, BucketOf bucket_of) const {
    const int at = known_ ? positions_.backward_pos[static_cast<std::size_t>(b)] : -1;
    if (at < 0) return static_cast<std::size_t>(std::size(pending));
    std::size_t due = 0, i = 0;
    for (const auto& x : pending) {
      ++i;
      if (plan_->reduce_wait[static_cast<std::size_t>(bucket_of(x))] <= at) due = i;
    }
    return due;
  }
  std::size_t reductions_due(int b, std::span<const int> pending) const {
    return reductions_due(b, pending, [](int bucket) { return bucket; });
  }

 private:
  // A bucket's position is where its first unit runs; a unit of an already placed bucket adds
  // nothing (the runtime gathers that bucket again if it was freed in between).
  static void positions_of(const std::vector<int>& units, const std::vector<int>& bucket_of_unit, int k, std::vector<int>& order,
                           std::vector<int>& pos) {
    order.clear();
    pos.assign(static_cast<std::size_t>(k), -1);
    for (int u : units) {
      const int b = bucket_of_unit[static_cast<std::size_t>(u)];
      if (pos[static_cast<std::size_t>(b)] < 0) {
        pos[static_cast<std::size_t>(b)] = static_cast<int>(order.size());
        order.push_back(b);
      }
    }
  }

  // Per position of `order`: the buckets whose all-gathers are issued at its pre-hook after its
  // own, in position order.
  std::vector<std::vector<int>> issue_lists(const std::vector<int>& order, const std::vector<int>& issue, const char* which) const {
    std::vector<std::vector<int>> at(order.size());
    for (std::size_t p = 0; p < order.size(); ++p) {
      const int b = order[p], i = issue[static_cast<std::size_t>(b)];
      if (i > static_cast<int>(p))
        throw error(errc::invalid_argument, std::string("plan: bucket ") + std::to_string(b) + "'s " + which +
                                                " all-gather is issued at position " + std::to_string(i) + ", after its own position " +
                                                std::to_string(p) + " in the recorded order", {rank_, -1, {}});
      if (i < static_cast<int>(p)) at[static_cast<std::size_t>(i)].push_back(b);
    }
    return at;
  }

  static std::string list(const std::vector<int>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }

  int rank_;
  prefetch prefetch_;
  std::optional<schedule::plan> plan_;
  bool user_plan_;
  bool recording_ = true;  // recording the unit order of the first forward and backward
  bool checked_ = false;   // that record was checked across ranks
  bool known_ = false;     // an order is followed
  std::vector<int> recorded_forward_, recorded_backward_;
  std::vector<int> forward_units_, backward_units_;  // the order followed
  schedule::bucket_positions positions_;
  std::vector<std::vector<int>> forward_issue_at_, backward_issue_at_;  // per position: all-gathers issued there
};

}  // namespace fsdp::detail
