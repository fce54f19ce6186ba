#pragma once
//! \file plan: which units share a bucket and when each collective is issued and waited for.
//! The simulator runs a plan against a cost model; the runtime replays the same fields.
//!
//! Positions. A bucket's forward (backward) position is its rank in the order buckets first
//! run in the trace's forward (backward) order: position 0 runs first. A plan says, per bucket:
//!
//!   forward_issue[b]   the forward position at whose pre-hook b's all-gather is issued. Its own
//!                      position means on demand: issued at its own pre-hook, then waited for.
//!                      An earlier position p means prefetched: issued at p's pre-hook right
//!                      after p's own all-gather was waited for, so it runs during p's compute.
//!   backward_issue[b]  the same in backward (ignored when parameters stay gathered from
//!                      forward, reshard_after_forward = false).
//!   reduce_wait[b]     the backward position at whose end b's reduction must be complete: the
//!                      compute thread blocks there (after freeing that bucket's parameters and
//!                      before issuing its reduction). A position ends at the post of its
//!                      bucket's last unit, which for a unit open around others comes after
//!                      later positions ended. K (the bucket count) means finish_backward.
//!
//! Buckets issued at the same pre-hook are issued in position order. Prefetch depths make a
//! plan through one function, prefetch_plan(), which shard_group also uses for its Prefetch
//! option: forward_issue = max(0, position - depth), reduce_wait = position + 1 (one reduction
//! in flight). FSDP2's default (one bucket per unit, prefetch 1) is per_unit_prefetch(trace).
//!
//!   auto p = fsdp::schedule::from_policies(trace, fsdp::fixed_bytes{.bytes = 64 << 20},
//!                                          fsdp::prefetch{.forward = 2, .backward = 1});
//!   fsdp::schedule::validate(trace, p);   // throws fsdp::error naming the problem
//!   fsdp::shard_group<...> group{comm, {}, {.plan = p}};   // the runtime replays it

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/policy/prefetch.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp::schedule {

//! Buckets and issue points of a step. See the file comment for what each field means.
struct plan {
  std::string name;                  //!< for reports ("per_unit", "greedy", "best", ...)
  std::vector<int> bucket_of_unit;   //!< per unit: its bucket (0, 1, ... over consecutive units)
  std::vector<int> forward_issue;    //!< per bucket: forward position of its all-gather's issue
  std::vector<int> backward_issue;   //!< per bucket: backward position of its all-gather's issue
  std::vector<int> reduce_wait;      //!< per bucket: backward position its reduction must end by
  //! Per unit: the parameter bytes of the trace the plan was made for (empty: not known).
  //! shard_group refuses a plan whose unit bytes differ from its own units'.
  std::vector<std::size_t> unit_bytes{};

  int num_buckets() const noexcept { return bucket_of_unit.empty() ? 0 : bucket_of_unit.back() + 1; }
  friend bool operator==(const plan&, const plan&) = default;
};

//! The bucket orders of a trace: the bucket at each position and the position of each bucket.
struct bucket_positions {
  std::vector<int> forward;       //!< forward[p]: the bucket at forward position p
  std::vector<int> backward;      //!< backward[p]: the bucket at backward position p
  std::vector<int> forward_pos;   //!< forward_pos[b]: bucket b's forward position
  std::vector<int> backward_pos;  //!< backward_pos[b]: bucket b's backward position
};

namespace detail {
inline void order_of_buckets(const std::vector<int>& units, std::span<const int> bucket_of_unit, int buckets,
                             const char* which, std::vector<int>& order, std::vector<int>& pos) {
  order.clear();
  pos.assign(static_cast<std::size_t>(buckets), -1);
  int current = -1;
  for (int u : units) {
    const int b = bucket_of_unit[static_cast<std::size_t>(u)];
    if (b == current) continue;
    // A bucket whose units do not run back to back would be re-gathered in between by the
    // runtime; the model (and the plan's positions) needs each bucket to run as one piece.
    if (pos[static_cast<std::size_t>(b)] >= 0)
      throw error(errc::invalid_argument,
                  "plan: bucket " + std::to_string(b) + "'s units do not run back to back in the " + which +
                      " order (unit " + std::to_string(u) + " runs after bucket " + std::to_string(current) +
                      "); put units that run apart in different buckets");
    pos[static_cast<std::size_t>(b)] = static_cast<int>(order.size());
    order.push_back(b);
    current = b;
  }
}
}  // namespace detail

//! The forward and backward bucket orders of `bucket_of_unit` in the trace. Throws
//! fsdp::error(errc::invalid_argument) on an invalid trace or assignment, or when a bucket's
//! units do not run back to back in either order.
inline bucket_positions positions_of(const checked_trace& t, std::span<const int> bucket_of_unit) {
  detail::check_assignment(bucket_of_unit, t->num_units());
  const int k = bucket_of_unit.back() + 1;
  bucket_positions p;
  detail::order_of_buckets(t->forward_order, bucket_of_unit, k, "forward", p.forward, p.forward_pos);
  detail::order_of_buckets(t->backward_order, bucket_of_unit, k, "backward", p.backward, p.backward_pos);
  return p;
}

//! Throws fsdp::error(errc::invalid_argument) naming the first problem: an invalid trace or
//! bucket assignment, per-bucket vectors of the wrong length, an issue point after the
//! bucket's own position or before position 0, a reduce_wait not after the bucket's own
//! backward position or past K.
inline void validate(const checked_trace& t, const plan& p) {
  const bucket_positions pos = positions_of(t, p.bucket_of_unit);
  const int k = p.num_buckets();
  const std::string who = "plan" + (p.name.empty() ? std::string() : " '" + p.name + "'") + ": ";
  auto sized = [&](const std::vector<int>& v, const char* what) {
    if (static_cast<int>(v.size()) != k)
      throw error(errc::invalid_argument, who + what + " has " + std::to_string(v.size()) + " entries for " +
                                              std::to_string(k) + " buckets");
  };
  sized(p.forward_issue, "forward_issue");
  sized(p.backward_issue, "backward_issue");
  sized(p.reduce_wait, "reduce_wait");
  for (int b = 0; b < k; ++b) {
    const auto i = static_cast<std::size_t>(b);
    auto issue = [&](int at, int own, const char* what) {
      if (at < 0 || at > own)
        throw error(errc::invalid_argument, who + what + "[" + std::to_string(b) + "] = " + std::to_string(at) +
                                                " is outside [0, " + std::to_string(own) +
                                                "]: an all-gather is issued at or before the pre-hook of its "
                                                "bucket's own position (" + std::to_string(own) + ")");
    };
    issue(p.forward_issue[i], pos.forward_pos[i], "forward_issue");
    issue(p.backward_issue[i], pos.backward_pos[i], "backward_issue");
    const int w = p.reduce_wait[i];
    if (w <= pos.backward_pos[i] || w > k)
      throw error(errc::invalid_argument, who + "reduce_wait[" + std::to_string(b) + "] = " + std::to_string(w) +
                                              " is outside [" + std::to_string(pos.backward_pos[i] + 1) + ", " +
                                              std::to_string(k) + "]: a reduction is waited for after its bucket's "
                                              "backward position, at the latest by finish_backward (" +
                                              std::to_string(k) + ")");
  }
}

//! The plan of prefetch depths over known bucket positions: the all-gather of the bucket at
//! position p is issued at the pre-hook of position max(0, p - depth) (depth 0: on demand),
//! and one reduction is in flight (the reduction of the bucket at backward position p must
//! end by the end of position p + 1). A bucket missing from an order (it did not run in that
//! direction) is issued at position 0 and its reduction waited for by finish_backward. The one
//! function from_policies() and shard_group's Prefetch option share. Throws
//! fsdp::error(errc::invalid_argument) on a negative depth.
inline plan prefetch_plan(const bucket_positions& pos, std::vector<int> bucket_of_unit, int forward_depth,
                          int backward_depth, std::string name = "prefetch") {
  if (forward_depth < 0 || backward_depth < 0)
    throw error(errc::invalid_argument, "plan: prefetch depths must be >= 0");
  plan p;
  p.name = std::move(name);
  p.bucket_of_unit = std::move(bucket_of_unit);
  const auto k = static_cast<std::size_t>(p.num_buckets());
  p.forward_issue.assign(k, 0);
  p.backward_issue.assign(k, 0);
  p.reduce_wait.assign(k, static_cast<int>(k));
  for (std::size_t at = 0; at < pos.forward.size(); ++at)
    p.forward_issue[static_cast<std::size_t>(pos.forward[at])] = std::max(0, static_cast<int>(at) - forward_depth);
  for (std::size_t at = 0; at < pos.backward.size(); ++at) {
    p.backward_issue[static_cast<std::size_t>(pos.backward[at])] = std::max(0, static_cast<int>(at) - backward_depth);
    p.reduce_wait[static_cast<std::size_t>(pos.backward[at])] = static_cast<int>(at) + 1;
  }
  return p;
}

//! prefetch_plan() over the trace's bucket orders for a bucket assignment. Throws
//! fsdp::error(errc::invalid_argument) on a negative depth or what positions_of() rejects.
inline plan from_policies(const checked_trace& t, std::vector<int> bucket_of_unit, int forward_depth = 1,
                          int backward_depth = 1, std::string name = "from_policies") {
  if (forward_depth < 0 || backward_depth < 0)
    throw error(errc::invalid_argument, "plan: prefetch depths must be >= 0");
  const bucket_positions pos = positions_of(t, bucket_of_unit);
  return prefetch_plan(pos, std::move(bucket_of_unit), forward_depth, backward_depth, std::move(name));
}

//! from_policies() with a BucketPolicy and a Prefetch value, as shard_group would apply them.
//! An explicit prefetch order must equal the trace's order (the runtime would otherwise
//! prefetch buckets that do not run next, which the model does not cover).
template <bucket_policy Bucket>
plan from_policies(const checked_trace& t, const Bucket& bucket, const prefetch& prefetch, std::string name = "from_policies") {
  std::vector<std::size_t> unit_bytes;
  for (const auto& u : t->units) unit_bytes.push_back(param_numel(u) * t->param_elem);
  const std::vector<int>& f = prefetch.forward_units;
  std::vector<int> backward = prefetch.backward_units;
  if (backward.empty() && !f.empty()) backward.assign(f.rbegin(), f.rend());  // as shard_group defaults it
  if ((!f.empty() && f != t->forward_order) || (!backward.empty() && backward != t->backward_order))
    throw error(errc::invalid_argument, "plan: the Prefetch policy's explicit unit order differs from the "
                                        "order in the trace; only the traced order can be modelled");
  return from_policies(t, bucket.assign(bucket_request{unit_bytes}), prefetch.forward, prefetch.backward, std::move(name));
}

//! FSDP2's default: one bucket per unit, prefetch `forward_depth` / `backward_depth` buckets
//! ahead, one reduction in flight.
inline plan per_unit_prefetch(const checked_trace& t, int forward_depth = 1, int backward_depth = 1) {
  std::vector<int> b(t->units.size());
  for (std::size_t u = 0; u < b.size(); ++u) b[u] = static_cast<int>(u);
  return from_policies(t, std::move(b), forward_depth, backward_depth, "per_unit");
}

//! The buckets as unit ranges: "greedy: 3 buckets [0-3 | 4 | 5-9]".
inline std::string describe_buckets(const plan& p) {
  std::string s = (p.name.empty() ? std::string("plan") : p.name) + ": " + std::to_string(p.num_buckets()) +
                  (p.num_buckets() == 1 ? " bucket [" : " buckets [");
  std::size_t u = 0;
  while (u < p.bucket_of_unit.size()) {
    std::size_t e = u;
    while (e + 1 < p.bucket_of_unit.size() && p.bucket_of_unit[e + 1] == p.bucket_of_unit[u]) ++e;
    // Appended piece by piece: "-" + std::to_string(e) and the like hit GCC 12's false
    // -Wrestrict at -O3 (GCC bugs 105329, 105651), an error under a user's -Werror.
    s.append(u ? " | " : "").append(std::to_string(u));
    if (e > u) s.append("-").append(std::to_string(e));
    u = e + 1;
  }
  return s + "]";
}

//! Every field: "plan{.name = ..., .bucket_of_unit = [...], ...}".
inline std::string to_string(const plan& p) {
  auto list = [](const std::vector<int>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  std::string bytes;
  for (std::size_t i = 0; i < p.unit_bytes.size(); ++i) bytes += (i ? ", " : "") + std::to_string(p.unit_bytes[i]);
  return "plan{.name = \"" + p.name + "\", .bucket_of_unit = " + list(p.bucket_of_unit) +
         ", .forward_issue = " + list(p.forward_issue) + ", .backward_issue = " + list(p.backward_issue) +
         ", .reduce_wait = " + list(p.reduce_wait) + (p.unit_bytes.empty() ? "" : ", .unit_bytes = [" + bytes + "]") + "}";
}

}  // namespace fsdp::schedule
