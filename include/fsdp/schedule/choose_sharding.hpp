#pragma once
//! \file choose_sharding: the shard-group size for a cluster, from the links measured at start
//! and a recorded step. On one host every rank shares one fast link; across hosts, a host's
//! ranks share its slower network link. measure_links() calibrates both levels (the ranks of a
//! host together; one rank per host alone on its link); choose_sharding() prices every shard
//! size whose groups follow the hosts (full, per host, ..., none) with the step simulator
//! under a per-rank memory limit, and picks the fastest, saying why.
//!
//!   const fsdp::schedule::host_links links = fsdp::schedule::measure_links(comm, queue);  // collective
//!   const fsdp::schedule::sharding_choice c = fsdp::schedule::choose_sharding(trace, links, 8 << 30);
//!   fsdp::shard_group<...> group{comm, {}, {.sharding = c.sharding}};    // c.why: the table
//!
//! The model of a group that spans hosts (cost_for): a collective's bytes go evenly to its
//! peers (traffic_counters::inter_host), the share for other hosts over the network link and
//! the rest over the host's own, in parallel; all ranks of a host cross at once, so each gets
//! 1 / ranks_per_host of the network link. Its latency is the larger of the two levels'.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/host.hpp"
#include "fsdp/policy/sharding.hpp"
#include "fsdp/schedule/calibrate.hpp"
#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp::schedule {

//! The links of a cluster of hosts × ranks_per_host ranks, consecutive per host.
struct host_links {
  int hosts = 1;
  int ranks_per_host = 1;
  std::optional<cost_model> intra;  //!< among the ranks of one host (absent with one rank per host)
  std::optional<cost_model> inter;  //!< one rank per host, alone on its host's link (absent with one host)
};

//! Collective over `comm`: calibrates the ranks of each host together (every host at once; host
//! 0's model is kept) and then one rank of each host alone on the network link, and gives every
//! rank the same figures. Throws fsdp::error(errc::invalid_argument) when hosts hold different
//! numbers of ranks or hold them out of order (topology::ranks_per_host() is 0).
template <class Comm>
  requires full_communicator<Comm> && std::same_as<typename Comm::device_type, host_device>
host_links measure_links(Comm& comm, queue_of<Comm>& queue, const calibrate_options& opts = {}) {
  const topology t = topology_of(comm);
  host_links l;
  l.hosts = t.hosts();
  l.ranks_per_host = t.ranks_per_host();
  if (l.ranks_per_host == 0)
    throw error(errc::invalid_argument, "measure_links: hosts hold different numbers of ranks, or out of order: " + t.str(),
                {comm.rank()});
  const int rank = comm.rank(), local = rank % l.ranks_per_host, host = rank / l.ranks_per_host;
  // Figures travel as 6 doubles per model: alpha and beta of all-gather, reduce-scatter, all-reduce.
  std::vector<double> shared(12, 0.0);
  auto pack = [&](const cost_model& m, std::size_t at) {
    const link_cost* k[3] = {&m.all_gather, &m.reduce_scatter, &m.all_reduce};
    for (std::size_t i = 0; i < 3; ++i) {
      shared[at + 2 * i] = k[i]->alpha_s;
      shared[at + 2 * i + 1] = k[i]->beta_bytes_per_s;
    }
  };
  auto unpack = [&](std::size_t at) {
    cost_model m;
    link_cost* k[3] = {&m.all_gather, &m.reduce_scatter, &m.all_reduce};
    for (std::size_t i = 0; i < 3; ++i) *k[i] = {shared[at + 2 * i], shared[at + 2 * i + 1]};
    return m;
  };
  if (l.ranks_per_host > 1) {
    Comm same_host = comm.split(host, rank);
    const cost_model m = calibrate(same_host, queue, opts);
    if (rank == 0) pack(m, 0);
  }
  if (l.hosts > 1) {
    Comm across = comm.split(local, rank);  // every rank takes part in the split; local 0 measures
    if (local == 0) {
      const cost_model m = calibrate(across, queue, opts);
      if (rank == 0) pack(m, 6);
    }
  }
  comm.broadcast(shared.data(), shared.size(), dtype::f64, 0, queue).wait(comm.timeout() * 2 + std::chrono::milliseconds(1000),
                                                                          "measure_links");
  if (l.ranks_per_host > 1) l.intra = unpack(0);
  if (l.hosts > 1) l.inter = unpack(6);
  return l;
}

namespace detail {
// A collective of a group whose fraction `f` of peers is on other hosts, each of the host's
// `crossing` ranks sending across at once.
inline link_cost mixed_link(const std::optional<link_cost>& intra, const std::optional<link_cost>& inter, double f, int crossing) {
  if (f <= 0 && intra) return *intra;
  if (!inter) throw error(errc::invalid_argument, "choose_sharding: a group spans hosts but no network link was measured");
  const double net = inter->beta_bytes_per_s / crossing;  // seconds per byte sent, each level
  double per_byte = f / net, alpha = inter->alpha_s;
  if (intra && f < 1) per_byte = std::max(per_byte, (1 - f) / intra->beta_bytes_per_s), alpha = std::max(alpha, intra->alpha_s);
  return {alpha, per_byte > 0 ? 1 / per_byte : std::numeric_limits<double>::infinity()};
}
}  // namespace detail

namespace detail {
//! The fractions of a rank's peers on other hosts in its shard group and in its replica group,
//! for shard groups of `s` consecutive ranks, `k` ranks per host.
struct remote_share {
  double shard = 0, replica = 0;
};
inline remote_share remote_share_of(int world, int k, int s) {
  const int r = world / s;
  remote_share f;
  // Shard group: s consecutive ranks; those on other hosts than a rank: s - k when s > k.
  if (s > 1 && s > k) f.shard = static_cast<double>(s - k) / (s - 1);
  // Replica group: one rank of each shard group; k / s of them per host when s < k.
  const int same_host = s < k ? k / s : 1;
  if (r > 1) f.replica = static_cast<double>(r - same_host) / (r - 1);
  return f;
}
}  // namespace detail

//! The cost model of shard groups of `shard_size` consecutive ranks on these links (all-gather
//! and reduce-scatter in the shard group, all-reduce across replicas).
inline cost_model cost_for(const host_links& l, int world, int shard_size) {
  const int k = l.ranks_per_host;
  const detail::remote_share f = detail::remote_share_of(world, k, shard_size);
  auto level = [&](const std::optional<cost_model>& m, link_cost cost_model::*kind) -> std::optional<link_cost> {
    if (!m) return std::nullopt;
    return (*m).*kind;
  };
  const double f_shard = f.shard, f_replica = f.replica;
  const int crossing = k;  // collectives run in lockstep: every rank of a host crosses at once
  cost_model c;
  c.all_gather = detail::mixed_link(level(l.intra, &cost_model::all_gather), level(l.inter, &cost_model::all_gather), f_shard, crossing);
  c.reduce_scatter =
      detail::mixed_link(level(l.intra, &cost_model::reduce_scatter), level(l.inter, &cost_model::reduce_scatter), f_shard, crossing);
  c.all_reduce = detail::mixed_link(level(l.intra, &cost_model::all_reduce), level(l.inter, &cost_model::all_reduce), f_replica, crossing);
  return c;
}

//! One shard size, priced.
struct sharding_candidate {
  fsdp::sharding sharding;
  int shard_size = 1;
  cost_model cost;
  step_trace trace;  //!< the recorded step with this shard size (what a bucket plan is made from)
  double step_s = 0;
  double exposed_comm_s = 0;
  std::size_t peak_bytes = 0;
  double inter_host_bytes = 0;  //!< sent per rank per step to other hosts (traffic_counters::inter_host)
  bool fits = true;             //!< peak_bytes within the memory limit
};

struct sharding_choice {
  fsdp::sharding sharding;
  std::size_t chosen = 0;  //!< index into candidates
  std::vector<sharding_candidate> candidates;
  std::string why;  //!< a line per candidate, the chosen one marked
};

//! Prices every shard size S dividing the world whose groups follow the hosts (S divides the
//! ranks per host, or is a multiple of it): `t` (a recorded step, any shard size) replayed with
//! S, FSDP2's default plan (a bucket per unit, prefetch `prefetch` deep), the cost of cost_for().
//! Picks the fastest whose peak fits `memory_limit` bytes per rank (0: no limit), except that
//! among those within 5% of the fastest it takes the one that sends the fewest bytes across
//! hosts (then the larger shard size, which needs less memory). The margin: the model does not
//! see the CPU time communication takes from compute where they share cores, nor other jobs on
//! the network; on the simulated cluster (docs/multi-host.md) full sharding modelled 2% slower
//! than hybrid at 1 Gbit/s and measured 8-12% slower. Throws fsdp::error(errc::invalid_argument)
//! when none fits.
inline sharding_choice choose_sharding(const step_trace& t, const host_links& l, std::size_t memory_limit = 0, int prefetch = 1) {
  const int w = t.world_size, k = l.ranks_per_host;
  sharding_choice out;
  for (int s = w; s >= 1; --s) {
    if (w % s != 0 || (s % k != 0 && k % s != 0)) continue;
    sharding_candidate c;
    c.shard_size = s;
    c.sharding = s == w ? full_shard() : s == 1 ? no_shard() : s == k ? hybrid_shard_per_host() : hybrid_shard(s);
    c.trace = t;
    c.trace.shard_size = s;
    c.trace.reshard_after_forward = c.sharding.reshard_after_forward;
    c.cost = cost_for(l, w, s);
    const checked_trace checked = c.trace;  // checked once, for the plan and the simulation
    const sim_result r = simulate(checked, c.cost, per_unit_prefetch(checked, prefetch, prefetch));
    c.step_s = r.step_s;
    c.exposed_comm_s = r.exposed_comm_s;
    c.peak_bytes = r.peak_bytes;
    const detail::remote_share f = detail::remote_share_of(w, k, s);
    for (const collective_record& x : r.collectives)
      c.inter_host_bytes += static_cast<double>(x.bytes) * (x.kind == collective_kind::all_reduce ? f.replica : f.shard);
    c.fits = memory_limit == 0 || r.peak_bytes <= memory_limit;
    out.candidates.push_back(std::move(c));
  }
  std::optional<std::size_t> fastest, best;
  for (std::size_t i = 0; i < out.candidates.size(); ++i)
    if (out.candidates[i].fits && (!fastest || out.candidates[i].step_s < out.candidates[*fastest].step_s)) fastest = i;
  for (std::size_t i = 0; fastest && i < out.candidates.size(); ++i) {  // largest shard size first: it wins ties
    const auto& c = out.candidates[i];
    if (c.fits && c.step_s <= out.candidates[*fastest].step_s * 1.05 &&
        (!best || c.inter_host_bytes < out.candidates[*best].inter_host_bytes))
      best = i;
  }
  char line[256];
  for (std::size_t i = 0; i < out.candidates.size(); ++i) {
    const auto& c = out.candidates[i];
    std::snprintf(line, sizeof line, "  %s %-26s step %.4f s (communication exposed %.4f s), %.2f MiB across hosts, peak %.2f MiB%s\n",
                  best && *best == i ? "->" : "  ", to_string(c.sharding).c_str(), c.step_s, c.exposed_comm_s,
                  c.inter_host_bytes / (1 << 20), static_cast<double>(c.peak_bytes) / (1 << 20), c.fits ? "" : " (over the memory limit)");
    out.why += line;
  }
  if (!best)
    throw error(errc::invalid_argument, "choose_sharding: no shard size fits the memory limit of " + std::to_string(memory_limit) +
                                            " bytes per rank:\n" + out.why);
  out.chosen = *best;
  out.sharding = out.candidates[*best].sharding;
  return out;
}

}  // namespace fsdp::schedule
