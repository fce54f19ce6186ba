#pragma once
//! \file process_groups: the communicators a shard_group runs on. The world is the caller's;
//! the shard group (ranks sharing one copy of the parameters) and the replica group (ranks
//! holding the same shard) are split from it, or are the world itself, or are absent when they
//! would have one rank; so is the secondary group of hpZ (sharding contract 3), when asked for. Also the set-up collectives that move host values: agree_across_ranks,
//! a sum over the shard group and a mean over the world.
//!
//! Ranks are laid out as HSDP does: shard groups are runs of S consecutive ranks, a replica
//! group takes one rank from each.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/policy/sharding.hpp"

namespace fsdp::detail {

template <full_communicator Comm, class Device>
class process_groups {
 public:
  using queue_t = typename Device::queue;
  using buffer_t = typename Device::buffer;

  process_groups(Comm& world, Device& device, milliseconds wait_timeout)
      : world_(world), device_(device), wait_timeout_(wait_timeout), traffic_at_start_(world.traffic()),
        topology_(topology_of(world)) {}

  //! Collective: splits the shard and replica groups for `s`. Throws errc::invalid_argument
  //! when the shard size does not divide the world size, or a shard group per host is asked
  //! for and the hosts hold different numbers of ranks or hold them out of order.
  void split(const sharding& s) {
    const int world = world_.size(), me = world_.rank();
    const int per_host = topology_.ranks_per_host();
    if (s.shard_size == sharding::per_host && per_host == 0)
      throw error(errc::invalid_argument,
                  to_string(s) + ": a shard group per host needs as many ranks on every host, in consecutive runs of ranks "
                                 "(mpiexec --map-by slot); the ranks' hosts are " + topology_.str() +
                                 ": give a shard size instead (hybrid_shard(S))",
                  {me, -1, {}});
    shard_size_ = s.shard_group_size(world, per_host);
    if (shard_size_ < 1 || world % shard_size_ != 0)
      throw error(errc::invalid_argument, to_string(s) + ": a shard group of " + std::to_string(shard_size_) +
                                              " ranks does not divide the world size " + std::to_string(world),
                  {me, -1, {}});
    const int replicas = world / shard_size_;
    if (shard_size_ == world) {
      shard_ = &world_;
    } else if (shard_size_ > 1) {
      owned_shard_.emplace(world_.split(me / shard_size_, me));
      shard_ = &*owned_shard_;
    }
    if (replicas == world) {
      replica_ = &world_;
    } else if (replicas > 1) {
      owned_replica_.emplace(world_.split(me % shard_size_, me));
      replica_ = &*owned_replica_;
    }
    shard_rank_ = shard_ ? shard_->rank() : 0;
    if (const int k = s.reshard_after_forward_to; k != 0) {
      if (!s.reshard_after_forward || k < 2 || k >= shard_size_ || shard_size_ % k != 0)
        throw error(errc::invalid_argument, to_string(s) + ": reshard_after_forward_to needs reshard_after_forward and a size " +
                                                "in (1, " + std::to_string(shard_size_) + ") dividing the shard group's " +
                                                std::to_string(shard_size_) + " ranks", {me, -1, {}});
      owned_secondary_.emplace(world_.split(me / k, me));  // k consecutive ranks, inside one shard group
    }
  }

  Comm& world() noexcept { return world_; }
  Comm* shard() noexcept { return shard_; }      //!< null when S == 1
  Comm* replica() noexcept { return replica_; }  //!< null when R == 1
  //! The k ranks a secondary shard spans (sharding contract 3); null when not asked for.
  Comm* secondary() noexcept { return owned_secondary_ ? &*owned_secondary_ : nullptr; }
  int shard_size() const noexcept { return shard_size_; }
  int shard_rank() const noexcept { return shard_rank_; }
  int replica_size() const noexcept { return world_.size() / shard_size_; }
  //! The hosts of the world's ranks.
  const fsdp::topology& topology() const noexcept { return topology_; }

  //! Bytes this rank sent through its communicators since the group was built.
  traffic_counters traffic() const {
    traffic_counters t = world_.traffic() - traffic_at_start_;
    if (owned_shard_) t = t + owned_shard_->traffic();
    if (owned_replica_) t = t + owned_replica_->traffic();
    if (owned_secondary_) t = t + owned_secondary_->traffic();
    return t;
  }

  //! Collective over the world: nullopt when every rank passes the same values; else the odd
  //! rank and the reference it differs from, the same on every rank. The reference is the
  //! values most ranks hold (a tie: those of the lowest rank among them); the odd rank is the
  //! lowest rank whose values differ from it. Values of different lengths are exchanged too
  //! (each padded to the longest), so the caller can name where they part.
  template <class T>
  struct disagreement {
    int odd_rank;
    std::vector<T> odd;
    int ref_rank;
    std::vector<T> ref;
  };
  template <class T>
  std::optional<disagreement<T>> agree_across_ranks(std::span<const T> mine, queue_t& q) {
    const auto n = static_cast<std::size_t>(world_.size());
    const std::vector<std::vector<T>> all = all_gather_variable(mine, q);
    auto of = [&](std::size_t r) { return std::span<const T>(all[r]); };
    auto same = [&](std::size_t r, std::size_t s) { return std::ranges::equal(of(r), of(s)); };
    bool all_same = true;
    for (std::size_t r = 1; r < n && all_same; ++r) all_same = same(r, 0);
    if (all_same) return std::nullopt;
    // Set-up only, and only on this error path: quadratic in the ranks is fine.
    std::size_t ref = 0, ref_count = 0;
    for (std::size_t r = 0; r < n; ++r) {
      std::size_t count = 0;
      for (std::size_t s = 0; s < n; ++s) count += same(r, s) ? 1 : 0;
      if (count > ref_count) {
        ref = r;
        ref_count = count;
      }
    }
    std::size_t odd = 0;
    while (same(odd, ref)) ++odd;
    auto copy = [&](std::size_t r) { return std::vector<T>(of(r).begin(), of(r).end()); };
    return disagreement<T>{static_cast<int>(odd), copy(odd), static_cast<int>(ref), copy(ref)};
  }
  //! Collective over the world: every rank's values, which may differ in length (two
  //! all-gathers: the lengths, then the values padded to the longest).
  template <class T>
  std::vector<std::vector<T>> all_gather_variable(std::span<const T> mine, queue_t& q) {
    const auto n = static_cast<std::size_t>(world_.size());
    std::uint64_t len = mine.size();
    std::vector<std::uint64_t> lens(n);
    all_gather_bytes(&len, lens.data(), sizeof len, q);
    const std::size_t longest = static_cast<std::size_t>(*std::max_element(lens.begin(), lens.end()));
    std::vector<std::vector<T>> out(n);
    if (longest == 0) return out;  // every rank passed nothing
    std::vector<T> padded(mine.begin(), mine.end());
    padded.resize(longest);
    std::vector<T> all(longest * n);
    all_gather_bytes(padded.data(), all.data(), longest * sizeof(T), q);
    for (std::size_t r = 0; r < n; ++r)
      out[r].assign(all.begin() + static_cast<std::ptrdiff_t>(r * longest), all.begin() + static_cast<std::ptrdiff_t>(r * longest + lens[r]));
    return out;
  }
  //! Collective over the world: whether every rank passes the same length (one all-gather).
  bool same_length_everywhere(std::uint64_t len, queue_t& q) {
    std::vector<std::uint64_t> lens(static_cast<std::size_t>(world_.size()));
    all_gather_bytes(&len, lens.data(), sizeof len, q);
    return std::all_of(lens.begin(), lens.end(), [&](std::uint64_t l) { return l == len; });
  }

  //! Collective over the world: `mine` holds a checksum per bucket of this rank's shard. Returns
  //! the first (rank, bucket) where a replica of the same shard holds another checksum.
  std::optional<std::pair<int, std::size_t>> replica_differs(std::span<const std::uint64_t> mine, queue_t& q) {
    std::vector<std::uint64_t> all(mine.size() * static_cast<std::size_t>(world_.size()));
    all_gather_bytes(mine.data(), all.data(), mine.size() * sizeof(std::uint64_t), q);
    const int me = world_.rank();
    for (int r = me % shard_size_; r < world_.size(); r += shard_size_)
      for (std::size_t b = 0; b < mine.size(); ++b)
        if (all[static_cast<std::size_t>(r) * mine.size() + b] != mine[b]) return std::pair{r, b};
    return std::nullopt;
  }

  //! Collective over the shard group: the sum over its ranks of a per-rank double.
  double shard_sum(double local, queue_t& q) {
    if (!shard_) return local;
    double v = local;
    shard_->all_reduce(&v, &v, 1, dtype::f64, reduce_op::sum, q).wait(wait_timeout_, "all_reduce");
    return v;
  }

  //! Collective over the world: each pointed-to value replaced by its mean over the ranks (every
  //! rank must pass as many; same_length_everywhere checks that first).
  void average(std::span<double* const> slots, queue_t& q) {
    std::vector<double> values;
    for (double* x : slots) values.push_back(*x);
    const std::size_t bytes = values.size() * sizeof(double);
    buffer_t sum = device_.allocate(bytes, mem_kind::transient);
    device_.copy_from_host(sum.data(), values.data(), bytes);
    world_.all_reduce(sum.data(), sum.data(), values.size(), dtype::f64, reduce_op::avg, q).wait(wait_timeout_, "all_reduce");
    device_.copy_to_host(values.data(), sum.data(), bytes);
    for (std::size_t i = 0; i < slots.size(); ++i) *slots[i] = values[i];
  }

  //! Collective over the world: host bytes in, every rank's bytes out, through device memory
  //! (NCCL needs device buffers).
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes, queue_t& q) {
    const auto n = static_cast<std::size_t>(world_.size());
    buffer_t staging = device_.allocate(bytes * n, mem_kind::transient);
    char* mine = static_cast<char*>(staging.data()) + bytes * static_cast<std::size_t>(world_.rank());
    device_.copy_from_host(mine, send, bytes);
    world_.all_gather(mine, staging.data(), bytes, dtype::u8, q).wait(wait_timeout_, "all_gather");
    device_.copy_to_host(recv, staging.data(), bytes * n);
  }

 private:
  Comm& world_;
  Device& device_;
  milliseconds wait_timeout_;
  traffic_counters traffic_at_start_;
  fsdp::topology topology_;
  std::optional<Comm> owned_shard_;
  std::optional<Comm> owned_replica_;
  std::optional<Comm> owned_secondary_;
  Comm* shard_ = nullptr;
  Comm* replica_ = nullptr;
  int shard_size_ = 1;
  int shard_rank_ = 0;
};

}  // namespace fsdp::detail
