#pragma once
//! \file How an optimizer runs its per-element work over one bucket's shard: with the
//! device's execution policy, or on the host for a shard offloaded to host memory
//! (policy/offload.hpp, contract 2), once the device's compute, which the reductions that wrote
//! its gradients were joined to by finish_backward, has run.

#include <cmath>
#include <cstddef>
#include <string>

#include <thrust/system/cpp/execution_policy.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/device/concepts.hpp"

namespace fsdp::detail {

//! f(policy), with the execution policy that reaches the shard's memory.
template <class Group, class View, class F>
auto on_shard(Group& group, const View& shard, F f) {
  if (shard.kind == mem_kind::offloaded) {
    group.device().compute_record().wait(default_timeout(), "the device's work before an offloaded optimizer step");
    return f(thrust::cpp::par);
  }
  return f(group.device().execution_policy());
}

template <class Group, class View, class Op>
void for_each_element(Group& group, const View& shard, Op op) {
  on_shard(group, shard, [&](const auto& policy) { for_each_index(policy, shard.numel, op); });
}

//! An optimizer's step(grad_scale) takes a finite factor >= 0 (errc::invalid_argument, at the
//! door, before anything changes).
inline void check_grad_scale(float grad_scale, const char* optimizer, int rank) {
  if (!(grad_scale >= 0.0f) || !std::isfinite(grad_scale))
    throw error(errc::invalid_argument, std::string(optimizer) + ": step's grad_scale must be finite and >= 0, got " +
                                            std::to_string(grad_scale), {rank});
}

//! Collective over the shard group; for an optimizer's refuse_nonfinite_grads, before its step
//! changes anything. Throws errc::non_finite on every rank when a gradient shard of one holds
//! nan or inf: all of them, so that every rank can retry the step alike. The rank holding it
//! names the parameter and the element (the first of its shards, in bucket order).
template <class Group>
void refuse_nonfinite_grads(Group& group, const char* optimizer) {
  std::size_t b = 0, k = 0;
  for (; b < group.num_buckets(); ++b) {
    const auto s = group.shard(b);
    k = on_shard(group, s, [&](const auto& policy) { return first_nonfinite(policy, s.grads, s.numel); });
    if (k < s.numel) break;
  }
  const bool mine = b < group.num_buckets();
  if (group.shard_group_sum(mine ? 1.0 : 0.0) == 0.0) return;
  const std::string what = std::string(optimizer) + ": step refused, nothing changed (refuse_nonfinite_grads): ";
  if (!mine) throw error(errc::non_finite, what + "another rank's gradient shard holds nan or inf", {group.rank()});
  const std::size_t at = group.layout(b).position(group.shard_rank(), k);  // in the bucket's flat buffer
  if (const auto e = group.layout(b).entry_at(at))
    throw error(errc::non_finite, what + "gradient element " + std::to_string(at - group.layout(b)[*e].offset) + " is nan or inf",
                {group.rank(), -1, group.parameters(b)[*e].name});
  throw error(errc::non_finite, what + "bucket " + std::to_string(b) + "'s padding holds nan or inf", {group.rank()});
}

//! An optimizer's step begins here: the backward pass finished, then, with refuse_nonfinite,
//! refuse_nonfinite_grads's check. That check's verdict is read on the host, so inside a CUDA
//! graph capture it refuses by name first, before anything changes.
template <class Group>
void finish_backward_for_step(Group& group, bool refuse_nonfinite, const char* optimizer) {
  if (refuse_nonfinite)
    refuse_in_capture(group.device(), std::string(optimizer) + ": refuse_nonfinite_grads",
                      "its check reads the gradients' verdict on the host, which captured work cannot wait for", group.rank());
  group.finish_backward();
  if (refuse_nonfinite) refuse_nonfinite_grads(group, optimizer);
}

}  // namespace fsdp::detail
