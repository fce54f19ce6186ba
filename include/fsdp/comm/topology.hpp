#pragma once
//! \file Topology: which ranks of a group share a host. A backend that knows it gives
//! hosts(), the host index of every rank of the group (MPI: MPI_Comm_split_type shared
//! memory; threads: world_options::ranks_per_host, for tests); for any other every rank is on
//! one host. It decides two things: the part of the traffic counted as inter-host
//! (traffic_counters::inter_host) and the shard group of hybrid_shard_per_host().
//!
//!   const fsdp::topology t = fsdp::topology_of(comm);
//!   t.hosts();          // 2
//!   t.ranks_per_host(); // 2, or 0 when hosts hold different numbers of ranks
//!   t.remote_peers(1);  // ranks of the group on another host than rank 1

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "fsdp/comm/concepts.hpp"

namespace fsdp {

//! A communicator that knows its ranks' hosts: hosts()[r] is the host index of rank r,
//! numbered 0, 1, ... in order of first appearance in the group.
template <class C>
concept knows_hosts = communicator<C> && requires(const C& c) {
  { c.hosts() } -> std::convertible_to<std::span<const int>>;
};

//! The hosts of a group's ranks. Its contract:
//!   1. host_of[r] is the host index of rank r; ranks of one host have the same index;
//!   2. ranks_per_host() is the ranks of each host when every host holds as many and they are
//!      consecutive runs of ranks (ranks 0..k-1 on one host, k..2k-1 on the next, as
//!      `mpiexec --map-by slot` places them), else 0;
//!   3. remote_peers(r) counts the ranks on another host than rank r.
struct topology {
  std::vector<int> host_of;

  int size() const noexcept { return static_cast<int>(host_of.size()); }
  int hosts() const {
    std::vector<int> h = host_of;
    std::sort(h.begin(), h.end());
    return static_cast<int>(std::unique(h.begin(), h.end()) - h.begin());
  }
  int ranks_per_host() const {
    const int n = size(), h = hosts();
    if (n == 0 || n % h != 0) return 0;
    const int k = n / h;
    // n / k = h runs of k ranks, each on one host: as there are h hosts, each run is another.
    for (int r = 0; r < n; ++r)
      if (host_of[static_cast<std::size_t>(r)] != host_of[static_cast<std::size_t>(r - r % k)]) return 0;
    return k;
  }
  int remote_peers(int rank) const {
    const int mine = host_of[static_cast<std::size_t>(rank)];
    return static_cast<int>(std::count_if(host_of.begin(), host_of.end(), [&](int h) { return h != mine; }));
  }
  //! "2 hosts: [0 0 1 1]".
  std::string str() const {
    std::string s = std::to_string(hosts()) + (hosts() == 1 ? " host: [" : " hosts: [");
    // Appended piece by piece: g++ 12 at -O3 takes `" " + std::to_string(...)` for a memcpy that
    // may overlap (a false -Wrestrict, an error under FSDP_WERROR).
    for (std::size_t r = 0; r < host_of.size(); ++r) {
      if (r) s += ' ';
      s += std::to_string(host_of[r]);
    }
    return s + "]";
  }
};

//! The topology of `comm`'s group: from hosts() where the backend gives it, else one host.
template <communicator C>
topology topology_of(const C& comm) {
  if constexpr (knows_hosts<C>) {
    const std::span<const int> h = comm.hosts();
    return {std::vector<int>(h.begin(), h.end())};
  } else {
    return {std::vector<int>(static_cast<std::size_t>(comm.size()), 0)};
  }
}

namespace detail {
//! Host indices renumbered 0, 1, ... in order of first appearance.
inline std::vector<int> renumber_hosts(std::span<const int> keys) {
  std::vector<int> seen, out;
  for (int k : keys) {
    auto it = std::find(seen.begin(), seen.end(), k);
    if (it == seen.end()) seen.push_back(k), it = seen.end() - 1;
    out.push_back(static_cast<int>(it - seen.begin()));
  }
  return out;
}
}  // namespace detail

}  // namespace fsdp
