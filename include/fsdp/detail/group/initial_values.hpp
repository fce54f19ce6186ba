#pragma once
//! \file The initial values of a shard_group's buckets (finalize): each rank's master shard
//! filled from init::per_shard or broadcast from a root's handles (init::broadcast_from), the
//! check that replicas start equal, and the handles' own copies released. Free functions over a
//! bucket_store (detail/group/bucket_store.hpp), which owns the bytes.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <thrust/system/cpp/execution_policy.h>  // initial values are assembled on the host

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/init.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/param_traits.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/detail/group/unit_registry.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/detail/xxhash.hpp"

namespace fsdp::detail {

//! init::per_shard: each rank's shard from fill(slice, values) for the parts it owns,
//! assembled on the host and copied once per bucket.
template <class Store, class Fill>
void fill_per_shard(Store& store, const Fill& fill, int shard_rank) {
  using master_type = typename Store::master_type;
  using Params = typename Store::params_type;
  std::vector<float> tmp;
  std::vector<master_type> host;
  for (auto& b : store.all()) {
    host.assign(b.layout.shard_numel(), master_type{});
    for (int u : b.units) {
      auto& rec = store.units()[u];
      for (std::size_t i = 0; i < rec.params.size(); ++i) {
        const auto s = b.layout.slice(rec.first_entry + i, shard_rank);
        if (!s) continue;
        tmp.assign(s->numel, 0.0f);
        const Params& p = *rec.params[i];
        fill(param_slice{u, static_cast<int>(i), param_traits<Params>::name(p), s->param_offset, param_traits<Params>::numel(p)},
             std::span<float>(tmp));
        fsdp::detail::cast(thrust::cpp::par, host.data() + s->shard_offset, tmp.data(), s->numel);
      }
    }
    store.device().copy_from_host(b.master.data(), host.data(), b.master.bytes());
  }
}

//! init::broadcast_from: the root assembles each bucket from its handles' initial values and
//! broadcasts it over `world`; every rank keeps its shard.
template <class Store, class Comm, class Queue>
void broadcast_from(Store& store, int root, Comm& world, int shard_rank, Queue& q, milliseconds timeout) {
  using master_type = typename Store::master_type;
  using param_type = typename Store::param_type;
  using Params = typename Store::params_type;
  const int rank = world.rank();
  if (root < 0 || root >= world.size())
    throw error(errc::invalid_argument, "broadcast_from(" + std::to_string(root) + "): no such rank", {rank, -1, {}});
  std::vector<master_type> host;  // values are host memory
  for (auto& b : store.all()) {
    auto full = store.device().allocate(b.layout.padded_numel() * sizeof(master_type), mem_kind::transient);
    auto* dst = full.template as<master_type>();
    if (rank == root) {
      host.assign(b.layout.padded_numel(), master_type{});
      for (int u : b.units) {
        auto& rec = store.units()[u];
        for (std::size_t i = 0; i < rec.params.size(); ++i) {
          const Params& p = *rec.params[i];
          const auto* src = static_cast<const param_type*>(param_traits<Params>::initial_values(p));
          if (src == nullptr)
            throw error(errc::invalid_argument,
                        "broadcast_from(" + std::to_string(root) + "): the root's handle has no initial values",
                        {rank, u, unit_registry<Params>::param_name(p, i)});
          fsdp::detail::cast(thrust::cpp::par, host.data() + b.layout[rec.first_entry + i].offset, src, param_traits<Params>::numel(p));
        }
      }
      store.device().copy_from_host(dst, host.data(), full.bytes());
    }
    world.broadcast(dst, b.layout.padded_numel(), dtype_of<master_type>, root, q).wait(timeout, "broadcast");
    for (std::size_t g = 0; g < b.layout.regions().size(); ++g) {
      const flat_range chunk = b.layout.shard(shard_rank, g);
      store.device().copy(b.master.template as<master_type>() + b.layout.regions()[g].shard_offset, dst + chunk.begin, chunk.size() * sizeof(master_type));
    }
  }
}

//! Per bucket, XXH3 of this rank's master shard (its bytes copied to the host).
template <class Store>
std::vector<std::uint64_t> master_checksums(Store& store) {
  std::vector<std::uint64_t> out;
  std::vector<unsigned char> host;
  for (const auto& b : store.all()) {
    host.resize(b.master.bytes());
    store.device().copy_to_host(host.data(), b.master.data(), host.size());
    out.push_back(XXH3_64bits(host.data(), host.size()));
  }
  return out;
}

//! Collective (all-gathers a checksum per bucket). Replicas must start equal: a per_shard fill
//! that reads the rank would leave them apart for good, without a word.
template <class Store, class Groups, class Queue>
void require_replicas_agree(Store& store, Groups& groups, Queue& q, int rank) {
  if (auto d = groups.replica_differs(std::span<const std::uint64_t>(master_checksums(store)), q))
    throw error(errc::mismatch, "replicas start from different values: bucket " + std::to_string(d->second) + " ('" +
                                    store[static_cast<int>(d->second)].name + "') differs from rank " + std::to_string(d->first) +
                                    "'s, which holds the same shard; an init::per_shard fill must give every rank the same "
                                    "values (a function of unit, index and element)", {rank, -1, {}});
}

//! The handles drop the copies they were created with; every parameter unbound.
template <class Store>
void release_initial_values(Store& store) {
  using Params = typename Store::params_type;
  for (int u = 0; u < store.units().size(); ++u)
    for (Params* p : store.units()[u].params) {
      param_traits<Params>::release_initial_values(*p);
      param_traits<Params>::bind(*p, nullptr, nullptr);
    }
}

}  // namespace fsdp::detail
