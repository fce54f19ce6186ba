#pragma once
//! \file The cost model: a collective takes alpha + bytes / beta seconds, with bytes what this
//! rank sends under the ring formulas of traffic_counters (comm/concepts.hpp). For a ring, the
//! bytes a rank sends divided by the time is NCCL's "bus bandwidth", so beta is the busbw that
//! nccl-tests print and alpha the latency at small sizes.
//!
//!   auto c = fsdp::schedule::h100_nvlink(8);                  // a profile, for paper plans
//!   auto m = fsdp::schedule::calibrate(comm, queue);          // or measured (calibrate.hpp)
//!   double s = m.all_gather.seconds(64 << 20);                // 64 MiB sent by this rank
//!
//! Profiles price each kind by where its group runs: all-gather and reduce-scatter over the
//! shard group, all-reduce over the replica group (hybrid and no_shard). Alpha grows with the
//! ring: a ring collective of n ranks takes n - 1 steps (all-reduce 2(n - 1)), each paying a
//! per-hop latency, as NCCL's own tuning model charges it.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "fsdp/core/error.hpp"

namespace fsdp::schedule {

//! One kind of collective on one kind of link: seconds = alpha + sent bytes / beta.
struct link_cost {
  double alpha_s = 0;           //!< latency per collective, seconds (finite, >= 0)
  double beta_bytes_per_s = 0;  //!< bytes this rank sends per second (> 0; +infinity: free)

  //! Time of a collective in which this rank sends `sent_bytes`.
  double seconds(std::uint64_t sent_bytes) const noexcept {
    return alpha_s + static_cast<double>(sent_bytes) / beta_bytes_per_s;
  }
  friend bool operator==(const link_cost&, const link_cost&) = default;
};

//! The cost of each collective kind shard_group issues.
struct cost_model {
  link_cost all_gather;      //!< over the shard group (S ranks)
  link_cost reduce_scatter;  //!< over the shard group (S ranks)
  link_cost all_reduce;      //!< over the replica group (R ranks)
  friend bool operator==(const cost_model&, const cost_model&) = default;
};

namespace detail {
// The bytes one rank sends in each collective, as traffic_counters counts them (ring
// algorithms, comm/concepts.hpp): `count` elements of `elem` bytes per rank, a group of `n`.
inline std::uint64_t all_gather_bytes(std::size_t count, std::size_t elem, int n) noexcept {
  return static_cast<std::uint64_t>(count) * elem * static_cast<std::uint64_t>(n - 1);
}
inline std::uint64_t reduce_scatter_bytes(std::size_t count, std::size_t elem, int n) noexcept {
  return static_cast<std::uint64_t>(count) * elem * static_cast<std::uint64_t>(n - 1);
}
inline std::uint64_t all_reduce_bytes(std::size_t count, std::size_t elem, int n) noexcept {
  return 2 * static_cast<std::uint64_t>(count) * elem * static_cast<std::uint64_t>(n - 1) /
         static_cast<std::uint64_t>(n);
}

inline std::string format_seconds_and_rate(const link_cost& l) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "{.alpha_s = %g, .beta_bytes_per_s = %g}", l.alpha_s, l.beta_bytes_per_s);
  return buf;
}
}  // namespace detail

inline std::string to_string(const link_cost& l) { return "link_cost" + detail::format_seconds_and_rate(l); }
inline std::string to_string(const cost_model& c) {
  return "cost_model{.all_gather = " + detail::format_seconds_and_rate(c.all_gather) +
         ", .reduce_scatter = " + detail::format_seconds_and_rate(c.reduce_scatter) +
         ", .all_reduce = " + detail::format_seconds_and_rate(c.all_reduce) + "}";
}

//! Throws fsdp::error(errc::invalid_argument) unless every alpha is finite and >= 0 and every
//! beta is > 0 (infinity allowed).
inline void validate(const cost_model& c) {
  auto check = [](const link_cost& l, const char* kind) {
    if (!std::isfinite(l.alpha_s) || l.alpha_s < 0)
      throw error(errc::invalid_argument, std::string("cost_model: ") + kind + ".alpha_s must be finite and >= 0");
    if (!(l.beta_bytes_per_s > 0))
      throw error(errc::invalid_argument, std::string("cost_model: ") + kind + ".beta_bytes_per_s must be > 0");
  };
  check(c.all_gather, "all_gather");
  check(c.reduce_scatter, "reduce_scatter");
  check(c.all_reduce, "all_reduce");
}

// ---- H100 profiles ------------------------------------------------------------------------------

//! Constants of the H100 profiles, each with where its number comes from.
namespace h100 {
//! GPUs per node: DGX/HGX H100 has 8 H100 SXM joined by NVSwitch (NVLink 4).
inline constexpr int gpus_per_node = 8;
//! Ring bus bandwidth inside a node: 450 GB/s NVLink line rate per direction, ~20 % protocol
//! overhead leaves ~370 GB/s (sjeaugey, NVIDIA/nccl-tests#212); all_gather_perf on 8 H100
//! saturates at ~360 GB/s busbw, "exactly what we'd expect on H100" (NVIDIA/nccl-tests#326).
//! (An all-reduce with NVLink SHARP reaches ~480 GB/s busbw; the ring figure is used for it too.)
inline constexpr double nvlink_busbw = 360e9;
//! Ring bus bandwidth of an all-gather or reduce-scatter whose ring spans nodes (8 x 400 Gb/s
//! NDR per node, one ConnectX-7 per GPU): all_gather_perf measured ~200 GB/s busbw at 2 GB on
//! 32 nodes / 256 H100 (NVIDIA/nccl#1218), against 400 GB/s of NIC line rate per node.
inline constexpr double ib_ring_busbw = 200e9;
//! One GPU's NIC: 400 Gb/s = 50 GB/s line rate, less ~20 % protocol overhead (as for NVLink,
//! nccl-tests#212). The replica all-reduce of hybrid sharding has one GPU per node in its ring,
//! so its traffic leaves through that GPU's own NIC.
inline constexpr double ib_nic_busbw = 40e9;
//! NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, ring algorithm with the Simple
//! protocol that large messages use): base latency 8.4 us, plus 3.4 us per NVLink hop and
//! 9.6 us per network hop. A ring of n ranks over k nodes takes n - 1 steps (all-reduce
//! 2(n - 1)), k - 1 of them (2(k - 1)) across the network.
inline constexpr double base_latency_s = 8.4e-6;
inline constexpr double nvlink_hop_s = 3.4e-6;
inline constexpr double net_hop_s = 9.6e-6;
//! Ring latency of a collective with `steps` steps, `net_steps` of them across the network.
inline double ring_latency(int steps, int net_steps) {
  return base_latency_s + (steps - net_steps) * nvlink_hop_s + net_steps * net_hop_s;
}
}  // namespace h100

namespace detail {
// Nodes touched by a group of `ranks` members placed `stride` world ranks apart (shard groups
// are consecutive ranks, stride 1; replica groups take every S-th rank, stride S), ranks
// filling 8-GPU nodes in order.
inline int nodes_spanned(int ranks, int stride) {
  if (stride >= h100::gpus_per_node) return ranks;
  const long long span = static_cast<long long>(ranks - 1) * stride + 1;
  return static_cast<int>((span + h100::gpus_per_node - 1) / h100::gpus_per_node);
}
inline link_cost h100_ring(int ranks, int stride, bool all_reduce) {
  if (ranks <= 1) return {0, std::numeric_limits<double>::infinity()};  // nothing is sent
  const int nodes = nodes_spanned(ranks, stride);
  const int per_node = (ranks + nodes - 1) / nodes;  // members of the group in one node
  const int steps = all_reduce ? 2 * (ranks - 1) : ranks - 1;
  const int net_steps = all_reduce ? 2 * (nodes - 1) : nodes - 1;
  // Inside a node: NVLink. Across nodes: one member per node rings through its own NIC;
  // several members per node share that many NICs, up to the measured full-node ring figure.
  const double beta = nodes == 1      ? h100::nvlink_busbw
                      : per_node == 1 ? h100::ib_nic_busbw
                                      : std::min(h100::ib_ring_busbw, per_node * h100::ib_nic_busbw);
  return {h100::ring_latency(steps, net_steps), beta};
}
}  // namespace detail

//! H100 SXM with `shard_size` ranks per shard group and `replicas` groups, ranks filling
//! 8-GPU nodes in order: a group inside one node is priced at NVLink (h100::nvlink_busbw), a
//! shard group spanning nodes at the measured InfiniBand ring bandwidth (h100::ib_ring_busbw),
//! a replica group with one GPU per node at one NIC (h100::ib_nic_busbw). Alpha is NCCL's ring
//! latency for the group (h100::ring_latency). Throws on sizes below 1.
inline cost_model h100_infiniband(int shard_size, int replicas = 1) {
  if (shard_size < 1 || replicas < 1)
    throw error(errc::invalid_argument, "h100_infiniband: shard_size and replicas must be at least 1");
  cost_model c;
  c.all_gather = detail::h100_ring(shard_size, 1, false);
  c.reduce_scatter = c.all_gather;
  c.all_reduce = detail::h100_ring(replicas, shard_size, true);
  return c;
}

//! H100 SXM with a shard group of `shard_size` ranks placed `stride` world ranks apart, as the
//! data-parallel group of a tensor-parallel job is when the TP ranks are consecutive (TP t:
//! stride t; t = 8 puts every member on its own node, so each rings through one NIC), and
//! `replicas` such groups (hybrid) at stride shard_size * stride. h100_strided(s, 1, r) is
//! h100_infiniband(s, r). Throws on sizes below 1.
inline cost_model h100_strided(int shard_size, int stride, int replicas = 1) {
  if (shard_size < 1 || stride < 1 || replicas < 1)
    throw error(errc::invalid_argument, "h100_strided: shard_size, stride and replicas must be at least 1");
  cost_model c;
  c.all_gather = detail::h100_ring(shard_size, stride, false);
  c.reduce_scatter = c.all_gather;
  c.all_reduce = detail::h100_ring(replicas, shard_size * stride, true);
  return c;
}

//! H100 SXM inside one node: `ranks` (2..8) GPUs over NVLink 4, every kind at
//! h100::nvlink_busbw with NCCL's ring latency (8 ranks: 32 us for an all-gather).
inline cost_model h100_nvlink(int ranks = h100::gpus_per_node) {
  if (ranks < 1 || ranks > h100::gpus_per_node)
    throw error(errc::invalid_argument, "h100_nvlink: one node holds 1 to 8 ranks, got " + std::to_string(ranks));
  cost_model c;
  c.all_gather = detail::h100_ring(ranks, 1, false);
  c.reduce_scatter = c.all_gather;
  c.all_reduce = detail::h100_ring(ranks, 1, true);
  return c;
}

}  // namespace fsdp::schedule
