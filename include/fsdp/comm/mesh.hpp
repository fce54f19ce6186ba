#pragma once
//! \file A device mesh: the world's ranks as a grid of named dimensions, each a communicator
//! made by split (any backend's). The order is torchtitan's, outermost first: pp, dp_replicate,
//! dp_shard, tp; world rank = ((pp * R + dp_replicate) * S + dp_shard) * T + tp, so TP is
//! innermost and its ranks are consecutive, inside one host when they fit (`mpiexec --map-by
//! slot` places consecutive ranks on one host). fsdp shards over dp: a shard_group over
//! `mesh.dp()` with `mesh.sharding()` forms exactly the dp_shard groups and, across them, the
//! dp_replicate groups (hybrid_shard(S) is the mesh dp_replicate x dp_shard).
//!
//!   fsdp::mesh<fsdp::threads::communicator> m{world, {.dp_shard = 2, .tp = 2}};   // 4 ranks
//!   fsdp::shard_group<fsdp::buffer<float>> group{m.dp(), {}, {.sharding = m.sharding()}};
//!   m.tp().all_reduce(out, out, n, fsdp::dtype::f32, fsdp::reduce_op::sum, q);    // row-parallel
//!
//! Experts (a mixture-of-experts layer) have a dimension of their own, carved out of dp_shard as
//! torchtitan does: `ep` consecutive dp_shard ranks form an expert-parallel group, each holding
//! other experts (ep(): tokens travel between them by all-to-all), and each expert is sharded
//! over the ranks that hold it: expert_dp(), the dp ranks with the same ep index, with
//! expert_sharding(). Dense parameters shard over dp() as before.
//!
//! Checks at construction (errc::invalid_argument, naming the sizes): sizes below 1, or that do
//! not multiply to the world's size; an ep that does not divide dp_shard; a TP group that spans
//! hosts when a TP group fits in one host (tp a divisor of the ranks per host would keep each
//! inside one).

#include <optional>
#include <string>
#include <utility>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/policy/sharding.hpp"

namespace fsdp {

//! The sizes of a mesh's dimensions; dp_shard = 0 takes what the others leave of the world.
struct mesh_shape {
  int pp = 1;
  int dp_replicate = 1;
  int dp_shard = 0;
  int tp = 1;
  int ep = 1;  //!< expert parallel: groups of ep consecutive dp_shard ranks (divides dp_shard)
  friend bool operator==(const mesh_shape&, const mesh_shape&) = default;
};

//! "pp 2 x dp_replicate 1 x dp_shard 2 x tp 2" (and " (ep 2)" when there are experts)
inline std::string to_string(const mesh_shape& s) {
  return "pp " + std::to_string(s.pp) + " x dp_replicate " + std::to_string(s.dp_replicate) + " x dp_shard " +
         std::to_string(s.dp_shard) + " x tp " + std::to_string(s.tp) + (s.ep > 1 ? " (ep " + std::to_string(s.ep) + ")" : "");
}

//! One rank's view of the mesh: its coordinates and the communicators of its groups along
//! each dimension (pp(): the ranks that differ only in their pipeline stage, and so on; dp():
//! dp_replicate x dp_shard, the data-parallel ranks fsdp shards over). Collective to build
//! (every rank of `world`); the communicators live as long as the mesh.
template <can_split Comm>
class mesh {
 public:
  mesh(Comm& world, mesh_shape shape) : shape_(checked(world, shape)) {
    const int r = world.rank(), t = shape_.tp, s = shape_.dp_shard, d = shape_.dp_replicate * s;
    coords_ = {r / (d * t), r / (s * t) % shape_.dp_replicate, r / t % s, r % t};
    const auto [p, rep, sh, ti] = coords_;
    // Each group: the ranks equal in every other coordinate (the color), ordered along this one.
    pp_ = world.split((rep * s + sh) * t + ti, p);
    dp_ = world.split(p * t + ti, rep * s + sh);
    dp_replicate_ = world.split((p * s + sh) * t + ti, rep);
    dp_shard_ = world.split((p * shape_.dp_replicate + rep) * t + ti, sh);
    tp_ = world.split(r / t, ti);
    const int e = shape_.ep, groups = s / e;  // expert parallel: dp_shard = groups x ep
    ep_ = world.split(((p * shape_.dp_replicate + rep) * groups + sh / e) * t + ti, sh % e);
    expert_dp_ = world.split((p * e + sh % e) * t + ti, rep * groups + sh / e);
  }

  const mesh_shape& shape() const noexcept { return shape_; }
  //! This rank's coordinates: pp stage, dp_replicate, dp_shard and tp index.
  struct coordinates {
    int pp = 0, dp_replicate = 0, dp_shard = 0, tp = 0;
  };
  coordinates coords() const noexcept { return coords_; }

  Comm& pp() noexcept { return *pp_; }
  Comm& dp() noexcept { return *dp_; }
  Comm& dp_replicate() noexcept { return *dp_replicate_; }
  Comm& dp_shard() noexcept { return *dp_shard_; }
  Comm& tp() noexcept { return *tp_; }
  Comm& ep() noexcept { return *ep_; }
  Comm& expert_dp() noexcept { return *expert_dp_; }

  //! The sharding of a shard_group over dp(): full_shard() over dp_shard, hybrid_shard(S) when
  //! there are replicas.
  fsdp::sharding sharding() const { return shape_.dp_replicate == 1 ? full_shard() : hybrid_shard(shape_.dp_shard); }
  //! The sharding of a shard_group of experts over expert_dp(): over dp_shard / ep ranks.
  fsdp::sharding expert_sharding() const {
    return shape_.dp_replicate == 1 ? full_shard() : hybrid_shard(shape_.dp_shard / shape_.ep);
  }

 private:
  static mesh_shape checked(const Comm& world, mesh_shape s) {
    const int n = world.size();
    auto refuse = [&](const std::string& why) {
      throw error(errc::invalid_argument, "mesh " + to_string(s) + " over " + std::to_string(n) + " ranks: " + why, {world.rank()});
    };
    if (s.pp < 1 || s.dp_replicate < 1 || s.tp < 1 || s.ep < 1 || s.dp_shard < 0) refuse("every size must be at least 1 (dp_shard 0: the rest)");
    const int others = s.pp * s.dp_replicate * s.tp;
    if (s.dp_shard == 0) {
      if (n % others != 0) refuse("pp x dp_replicate x tp = " + std::to_string(others) + " does not divide the world");
      s.dp_shard = n / others;
    }
    if (others * s.dp_shard != n) refuse("the sizes multiply to " + std::to_string(others * s.dp_shard) + ", not the world's size");
    if (s.dp_shard % s.ep != 0) refuse("ep " + std::to_string(s.ep) + " does not divide dp_shard " + std::to_string(s.dp_shard));
    const topology hosts = topology_of(world);
    const int per_host = hosts.ranks_per_host();
    if (per_host > 0 && s.tp <= per_host && per_host % s.tp != 0)
      refuse("tp " + std::to_string(s.tp) + " puts TP groups across hosts of " + std::to_string(per_host) +
             " ranks (" + hosts.str() + "); a tp that divides " + std::to_string(per_host) + " keeps each inside one host");
    return s;
  }

  mesh_shape shape_;
  coordinates coords_{};
  std::optional<Comm> pp_, dp_, dp_replicate_, dp_shard_, tp_, ep_, expert_dp_;  // made in the constructor (no default constructor)
};

}  // namespace fsdp
