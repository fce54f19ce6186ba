#pragma once
//! \file How an optimizer runs its per-element update over one bucket's shard: with the
//! device's execution policy, or on the host for a shard offloaded to host memory
//! (policy/offload.hpp, contract 2), once the device's compute, which the reductions that wrote
//! its gradients were joined to by finish_backward, has run.

#include <cstddef>

#include <thrust/system/cpp/execution_policy.h>

#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/detail/kernels.hpp"

namespace fsdp::detail {

template <class Group, class View, class Op>
void for_each_element(Group& group, const View& shard, Op op) {
  if (shard.kind == mem_kind::offloaded) {
    group.device().compute_record().wait(default_timeout(), "the device's work before an offloaded optimizer step");
    for_each_index(thrust::cpp::par, shard.numel, op);
  } else {
    for_each_index(group.device().execution_policy(), shard.numel, op);
  }
}

}  // namespace fsdp::detail
