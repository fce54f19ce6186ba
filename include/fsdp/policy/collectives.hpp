#pragma once
//! \file Custom collectives: an engine's own all-gather of parameters and reduce-scatter of
//! gradients for one shard_group (FSDP2's set_custom_all_gather / set_custom_reduce_scatter),
//! e.g. a quantized gather or a collective library of its own. A value in shard_group's options,
//! chosen at run time; empty members keep the shard group communicator's own collective.
//!
//!   group_type::options opts;
//!   opts.collectives.all_gather = [](float* full, std::size_t n, comm_type& shard_group, queue_type& q) {
//!     ...  // enqueue on q whatever leaves every rank's n elements in place in `full`
//!   };

#include <cstddef>
#include <functional>

namespace fsdp {

//! The collectives a shard_group issues inside its shard group, replaceable. Its contract:
//!   1. all_gather(full, n, shard_group, q) is called where the group would all-gather a
//!      bucket, on the all-gather queue `q`, in the same order on every rank of the shard group.
//!      `full` holds S·n param-dtype elements with this rank's shard already in place at
//!      shard_group.rank()·n; when q has run what the hook enqueued, every rank's shard must be
//!      in place. The hook may enqueue collectives on `shard_group` (they are counted in
//!      traffic()) and tasks on q; what it allocates must outlive them (q.release, or a capture).
//!   2. reduce_scatter(full, shard, n, shard_group, q) is called where the group would
//!      reduce-scatter a bucket's gradient, on the reduce-scatter queue, likewise: `full` holds
//!      this rank's S·n reduce-dtype gradient elements; when q has run the hook's work, `shard`
//!      (n elements) must hold the *mean* over the shard group of chunk shard_group.rank().
//!   3. Neither is called when the shard group has one rank (no_shard()): nothing is sharded.
//!      The replicas' all-reduce, set-up collectives and checkpoints keep the communicator's own.
template <class Param, class Reduce, class Comm, class Queue>
struct custom_collectives {
  std::function<void(Param* full, std::size_t n, Comm& shard_group, Queue& q)> all_gather{};
  std::function<void(const Reduce* full, Reduce* shard, std::size_t n, Comm& shard_group, Queue& q)> reduce_scatter{};
};

}  // namespace fsdp
