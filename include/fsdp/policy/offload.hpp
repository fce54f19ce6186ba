#pragma once
//! \file Offload: which buckets keep their sharded state (master shard, gradient shard, the
//! sums held for the replicas, the optimizer's state) in host memory instead of the device's,
//! as FSDP2's CPUOffloadPolicy does for a whole model and ZeRO-Offload for the optimizer. A
//! value in shard_group's options, chosen at run time:
//!
//!   fsdp::offload{}                    nothing offloaded (the default)
//!   fsdp::offload{.units = {0, 1}}     the buckets holding units 0 and 1 (say an embedding)
//!   fsdp::offload_all()                every bucket
//!
//! Its contract:
//!   1. a bucket is offloaded when `every_unit` is set or it holds a unit listed in `units`;
//!   2. an offloaded bucket's state is allocated as mem_kind::offloaded (host memory, pinned on
//!      CUDA; memory_stats::offloaded_live counts it, not live), the optimizers step it on the
//!      host, and the device keeps only the gathered working set of it;
//!   3. what is gathered, reduced and stepped is the same as without offload: on the host device
//!      training is bit-identical.

#include <algorithm>
#include <vector>

namespace fsdp {

struct offload {
  std::vector<int> units{};  //!< a bucket holding any of these units is offloaded
  bool every_unit = false;   //!< every bucket is offloaded
  //! Contract 1, for a bucket holding `bucket_units`.
  bool covers(const std::vector<int>& bucket_units) const {
    return every_unit || std::any_of(bucket_units.begin(), bucket_units.end(),
                                     [&](int u) { return std::find(units.begin(), units.end(), u) != units.end(); });
  }
  friend bool operator==(const offload&, const offload&) = default;
};

inline offload offload_all() { return {.every_unit = true}; }

}  // namespace fsdp
