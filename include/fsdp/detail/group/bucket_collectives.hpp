#pragma once
//! \file How a bucket's bytes move (the bucket_store's buckets, bucket_store.hpp): its
//! all-gather (per region of its layout, with hpZ's secondary shard) and its reduction
//! (reduce-scatter, the replicas' all-reduce or a held sum, the accumulation into the gradient
//! shard), enqueued on a queue. When they are issued, and waited for, is the driver's
//! (shard_group.hpp).

#include <cstddef>
#include <type_traits>
#include <utility>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/detail/kernels.hpp"

namespace fsdp::detail {

//! The gathers and reductions of a bucket_store's buckets (Store: a bucket_store).
template <class Store>
struct bucket_collectives {
  using param_type = typename Store::param_type;
  using master_type = typename Store::master_type;
  using reduce_type = typename Store::reduce_type;
  using buffer_t = typename Store::buffer_t;
  using rules = typename Store::rules;
  using queue = typename Store::device_type::queue;

  //! Allocates bucket b's gathered buffer and enqueues on `q`, per region of its layout (two
  //! when it holds frozen parameters), the cast of this rank's chunk into place and the shard
  //! group's all-gather: `custom` (contract 1 of policy/collectives.hpp) when set, else the
  //! communicator's. With one rank per shard group (`shard` null) the cast is all there is.
  //! A bucket holding a secondary shard (hpZ, keep_secondary) is gathered from it over
  //! `secondary` instead, with the communicator's all-gather, and the secondary is freed after.
  template <class Comm, class Custom>
  static void issue_gather(Store& store, int b, int shard_rank, Comm* shard, Comm* secondary, const Custom& custom, queue& q) {
    auto& k = store[b];
    // Written whole by the casts and gathers below: no zero fill, so no host wait on a GPU. The
    // queue is its first user (a captured step allocates there: device/cuda/memory.hpp).
    k.full = allocate_uninitialized(store.device(), k.layout.padded_numel() * sizeof(param_type), mem_kind::transient, q);
    k.full_ptr = k.full.template as<param_type>();
    const bool from_secondary = secondary && k.secondary;
    if (k.low_precision && !from_secondary && !k.low_precision_current) {
      // The whole shard (frozen elements too), once; later gathers read it as it is until a
      // shard view is handed out again (bucket_store::bucket::low_precision_current).
      q.launch([dst = k.low_precision.template as<param_type>(), src = k.master.template as<master_type>(),
                n = k.layout.shard_numel()](auto policy) { fsdp::detail::cast(policy, dst, src, n); });
      k.low_precision_current = true;
    }
    std::size_t secondary_offset = 0;
    for (const flat_region& g : k.layout.regions()) {
      param_type* full = k.full_ptr + g.offset;
      if (from_secondary) {
        const std::size_t n = g.numel / static_cast<std::size_t>(secondary->size());
        param_type* mine = full + static_cast<std::size_t>(secondary->rank()) * n;
        q.launch([mine, src = k.secondary.template as<param_type>() + secondary_offset, n](auto policy) { fsdp::detail::cast(policy, mine, src, n); });
        secondary->all_gather(mine, full, n, dtype_of<param_type>, q);
        secondary_offset += n;
        continue;
      }
      const std::size_t n = g.numel / static_cast<std::size_t>(k.layout.shards());
      param_type* mine = full + static_cast<std::size_t>(shard_rank) * n;
      const master_type* src = k.master.template as<master_type>() + g.shard_offset;
      if (k.low_precision) {
        // The kept copy in the gathered dtype: gathered as it is, or copied into place.
        const param_type* low = k.low_precision.template as<param_type>() + g.shard_offset;
        if (shard && !custom) {
          shard->all_gather(low, full, n, dtype_of<param_type>, q);
          continue;
        }
        q.launch([mine, low, n](auto policy) { fsdp::detail::cast(policy, mine, low, n); });
        if (shard) custom(full, n, *shard, q);
        continue;
      }
      if constexpr (std::is_same_v<param_type, master_type>) {
        // No cast: the communicator's all-gather reads the master shard itself (one task less
        // on the queue per region; contract 1 of policy/collectives.hpp gathers in place).
        if (shard && !custom) {
          shard->all_gather(src, full, n, dtype_of<param_type>, q);
          continue;
        }
      }
      q.launch([mine, src, n](auto policy) { fsdp::detail::cast(policy, mine, src, n); });
      if (shard && custom) custom(full, n, *shard, q);
      else if (shard) shard->all_gather(mine, full, n, dtype_of<param_type>, q);
    }
    if (from_secondary) q.release(std::exchange(k.secondary, buffer_t{}));
  }

  //! Issues bucket b's reduction on `q` (when is the driver's, shard_group.hpp): its gradient
  //! buffer cast to the reduce dtype, reduce-scattered (average) inside the shard group (`custom`,
  //! contract 2 of policy/collectives.hpp, when set), all-reduced (average) across replicas
  //! unless `hold` keeps the sum for a later reduction (hold_or_add_held), and added into the
  //! gradient shard. With one rank per shard group (`shard` null) the whole buffer is the shard.
  template <class Comm, class Custom>
  static void issue_reduction(Store& store, int b, Comm* shard, Comm* replica, bool hold, const Custom& custom, queue& q) {
    auto& k = store[b];
    const std::size_t n = k.layout.trainable_numel(), shard_n = k.layout.trainable_shard_numel();
    buffer_t red;
    if constexpr (!rules::reduce_dtype_differs) {
      red = std::move(k.grad_full);
    } else {
      red = allocate_uninitialized(store.device(), n * sizeof(reduce_type), mem_kind::transient, q);  // the cast writes it whole
      q.launch([dst = red.template as<reduce_type>(), g = k.grad_full.template as<param_type>(), n](auto policy) {
        detail::cast(policy, dst, g, n);
      });
      q.release(std::move(k.grad_full));
    }
    k.grad_full = buffer_t{};
    buffer_t out;
    // Into a gradient shard that holds zeros (zero_grad() since it was last written), the
    // reduce-scatter writes its result directly, as FSDP2 assigns a first sharded gradient rather
    // than adding it: no output buffer, no accumulation pass, one queue task less. Same values:
    // 0 + x is x (up to the sign of a zero).
    const bool into_shard = std::is_same_v<reduce_type, master_type> && k.grad_shard_zero && shard &&
                            !replica && k.state_kind != mem_kind::offloaded;
    k.grad_shard_zero = false;
    if (shard) {
      void* dst = k.grad_shard.data();
      if (!into_shard) {
        out = allocate_uninitialized(store.device(), shard_n * sizeof(reduce_type), mem_kind::transient, q);  // the reduction writes it whole
        dst = out.data();
      }
      if (custom) custom(red.template as<reduce_type>(), static_cast<reduce_type*>(dst), shard_n, *shard, q);
      else shard->reduce_scatter(red.data(), dst, shard_n, dtype_of<reduce_type>, reduce_op::avg, q);
      q.release(std::move(red));
    } else {
      out = std::move(red);  // one rank per shard group: the whole buffer is the shard
    }
    if (replica) {
      hold_or_add_held(store, b, hold, out.template as<reduce_type>(), q);
      if (!hold) replica->all_reduce(out.data(), out.data(), shard_n, dtype_of<reduce_type>, reduce_op::avg, q);
    }
    if (!hold && !into_shard)
      q.launch([dst = k.grad_shard.template as<master_type>(), o = out.template as<reduce_type>(), shard_n](auto policy) {
        detail::accumulate(policy, dst, o, shard_n);
      });
    if (out) q.release(std::move(out));
  }

  //! hpZ, at the reshard after bucket b's forward (its gather waited for): keeps this rank's
  //! part of the gathered buffer for the k ranks of `secondary`, chunk secondary->rank() of each
  //! region, so its backward gathers among them.
  template <class Comm>
  static void keep_secondary(Store& store, int b, Comm& secondary) {
    auto& k = store[b];
    const auto parts = static_cast<std::size_t>(secondary.size()), me = static_cast<std::size_t>(secondary.rank());
    k.secondary = allocate_uninitialized(store.device(), k.layout.padded_numel() / parts * sizeof(param_type), mem_kind::transient);
    std::size_t offset = 0;
    for (const flat_region& g : k.layout.regions()) {
      const std::size_t n = g.numel / parts;
      store.device().copy(k.secondary.template as<param_type>() + offset, k.full_ptr + g.offset + me * n, n * sizeof(param_type));
      offset += n;
    }
  }

 private:
  // On `q`, for a reduction's output `out` (reduce_type[shard_numel]) when the group has
  // replicas: with `hold`, adds it into bucket b's held sum (made on the first hold) instead of
  // the all-reduce; without, adds the held sum, if any, into `out` before the all-reduce and
  // frees it. So micro-batches reduce-scattered apart cost one all-reduce together.
  static void hold_or_add_held(Store& store, int b, bool hold, reduce_type* out, queue& q) {
    auto& k = store[b];
    const std::size_t n = k.layout.trainable_shard_numel();
    if (!hold) {
      if (!k.held) return;
      q.launch([out, h = k.held.template as<reduce_type>(), n](auto policy) { fsdp::detail::accumulate(policy, out, h, n); });
      q.release(std::exchange(k.held, buffer_t{}));
      return;
    }
    const bool first = !k.held;  // the first hold copies (a fresh buffer holds no zeros)
    if (first) k.held = allocate_uninitialized(store.device(), n * sizeof(reduce_type), k.state_kind, q);
    q.launch([h = k.held.template as<reduce_type>(), out, n, first](auto policy) {
      if (first) fsdp::detail::cast(policy, h, out, n);
      else fsdp::detail::accumulate(policy, h, out, n);
    });
  }
};

}  // namespace fsdp::detail
