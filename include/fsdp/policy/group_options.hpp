#pragma once
//! \file group_options: the run-time choices of a shard_group, in one value
//! (shard_group<...>::options is this type for the group's BucketPolicy and collectives):
//!
//!   fsdp::shard_group<fsdp::buffer<float>> group{
//!       comm, {}, {.sharding = fsdp::hybrid_shard(2), .prefetch = {.forward = 1, .backward = 1}}};
//!
//! Each field is a policy of its own header (sharding, prefetch, bucket, collectives, offload);
//! detail::check_options (detail/group/policies.hpp) refuses the ones that do not go together.

#include <optional>

#include "fsdp/policy/offload.hpp"
#include "fsdp/policy/prefetch.hpp"
#include "fsdp/policy/sharding.hpp"
#include "fsdp/schedule/plan.hpp"

namespace fsdp {

template <class Bucket, class Collectives>
struct group_options {
  fsdp::sharding sharding = full_shard();
  fsdp::prefetch prefetch{};
  Bucket bucket{};
  //! A plan to replay (auto_bucket's, or one written by hand): its buckets and issue points
  //! replace the BucketPolicy and the prefetch depths, so those must stay at their defaults.
  std::optional<schedule::plan> plan{};
  Collectives collectives{};  //!< the shard group's all-gather and reduce-scatter, replaced (policy/collectives.hpp)
  fsdp::offload offload{};    //!< buckets whose sharded state lives in host memory (policy/offload.hpp)
  //! The all-gather and reduce-scatter queues at high priority where queues have one (CUDA
  //! streams, as FSDP2 and Megatron-FSDP make them), so their kernels start ahead of compute's.
  bool collectives_high_priority = true;
  //! Keep each rank's shard in the gathered dtype too, beside the master (where the two
  //! differ: bf16 over an f32 master, 2 more persistent bytes a parameter), so that the
  //! all-gather reads it instead of casting the master at every gather (twice a step when
  //! resharding after forward). fsdp's optimizers write it in their own pass
  //! (shard_view::low_precision); after any other write through a shard view, the next gather
  //! casts it again (shard_group::low_precision_written).
  bool keep_low_precision_shard = false;
};

}  // namespace fsdp
