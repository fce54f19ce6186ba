#pragma once
//! \file memory_bound: the peak transient bytes a shard_group promises, from its buckets' sizes
//! and the plan it replays. One formula, read position by position:
//!
//!   forward, at position p:  the gathered buckets whose all-gather was issued at or before p
//!                            and that run at or after p (every bucket when parameters stay
//!                            gathered from forward to backward, reshard_after_forward = false)
//!   backward, at position p: those gathered buckets, plus p's gradient buffer, plus every
//!                            reduction issued before p that is waited for at p or later; and
//!                            at p's end, p's own reduction with those issued before it that
//!                            are waited for after p
//!
//! Until the first step has recorded the order, positions are unknown: the bound then takes
//! every bucket to be as large as the largest, which makes the formula for prefetch depths
//!   forward  = (1 + forward depth) x largest gathered bucket (at most all of them)
//!   backward = (1 + backward depth) x largest gathered bucket + largest gradient bucket
//!              + largest reduction (one in flight)
//! and for a plan given by the user, whose issue points and waits may reach any position, every
//! bucket gathered and every reduction in flight.
//! Neither models a unit that stays open around others (the simulator does). Activation
//! recomputation adds nothing: a recompute runs inside its unit's backward position, on the
//! bucket counted there.

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "fsdp/schedule/plan.hpp"

namespace fsdp::detail {

struct memory_bound {
  std::size_t forward;
  std::size_t backward;
};

//! Transient bytes of one bucket: gathered parameters (0 when they alias the master), its
//! gradient buffer, and a reduction in flight (gradients, reduce-dtype copy, output shard).
struct bucket_bytes {
  std::size_t gathered;
  std::size_t gradients;
  std::size_t reduction;
  std::size_t secondary = 0;  //!< hpZ's secondary shard, held from the bucket's forward to its backward
};

//! The bound for `bytes` (per bucket). `positions` is the order followed, null while it is
//! unknown; `plan` the plan replayed, null while the prefetch depths have made none yet (then
//! `forward_depth` / `backward_depth` are the depths it will have).
inline memory_bound gathered_and_reduced_bound(std::span<const bucket_bytes> bytes, bool reshard_after_forward,
                                               const schedule::bucket_positions* positions, const schedule::plan* plan,
                                               int forward_depth, int backward_depth) {
  std::size_t all = 0, largest = 0, largest_grad = 0, largest_red = 0, all_red = 0;
  for (const auto& b : bytes) {
    all += b.gathered;
    all_red += b.reduction;
    largest = std::max(largest, b.gathered);
    largest_grad = std::max(largest_grad, b.gradients);
    largest_red = std::max(largest_red, b.reduction);
  }
  if (positions == nullptr && plan != nullptr) return {all, all + largest_grad + all_red};
  if (positions == nullptr || plan == nullptr) {
    const auto window = [&](int depth) { return reshard_after_forward ? std::min(all, (1 + static_cast<std::size_t>(depth)) * largest) : all; };
    return {window(forward_depth), window(backward_depth) + largest_grad + largest_red};
  }
  // Bytes gathered during position p of `order` (or at its end: p freed, later ones kept).
  const auto gathered_at = [&](const std::vector<int>& order, const std::vector<int>& issue, std::size_t p, bool after) {
    if (!reshard_after_forward) return all;
    std::size_t sum = 0;
    for (std::size_t q = 0; q < order.size(); ++q) {
      const auto b = static_cast<std::size_t>(order[q]);
      const auto first = std::min(static_cast<std::size_t>(issue[b]), q);
      if (first <= p && (after ? p < q : p <= q)) sum += bytes[b].gathered;
    }
    return sum;
  };
  memory_bound out{0, 0};
  for (std::size_t p = 0; p < positions->forward.size(); ++p)
    out.forward = std::max(out.forward, gathered_at(positions->forward, plan->forward_issue, p, false));
  const auto& order = positions->backward;
  for (std::size_t p = 0; p < order.size(); ++p) {
    const auto b = static_cast<std::size_t>(order[p]);
    std::size_t during = bytes[b].gradients, after = bytes[b].reduction;
    for (std::size_t q = 0; q < p; ++q) {
      const auto j = static_cast<std::size_t>(order[q]);
      if (plan->reduce_wait[j] >= static_cast<int>(p)) during += bytes[j].reduction;
      if (plan->reduce_wait[j] > static_cast<int>(p)) after += bytes[j].reduction;
    }
    out.backward = std::max({out.backward, gathered_at(order, plan->backward_issue, p, false) + during,
                             gathered_at(order, plan->backward_issue, p, true) + after});
  }
  return out;
}

//! The bound, with hpZ's secondary shards counted at every position: a loose bound there (a
//! secondary lives only from its bucket's forward to its backward), kept simple.
inline memory_bound transient_memory_bound(std::span<const bucket_bytes> bytes, bool reshard_after_forward,
                                           const schedule::bucket_positions* positions, const schedule::plan* plan,
                                           int forward_depth, int backward_depth) {
  memory_bound out = gathered_and_reduced_bound(bytes, reshard_after_forward, positions, plan, forward_depth, backward_depth);
  for (const auto& b : bytes) {
    out.forward += b.secondary;
    out.backward += b.secondary;
  }
  return out;
}

}  // namespace fsdp::detail
