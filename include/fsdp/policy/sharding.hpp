#pragma once
//! \file Sharding: who owns which bytes, and so which collectives run. A value, chosen at run
//! time: the same shard_group type runs every strategy.
//!
//!   fsdp::full_shard()       ZeRO-3 / FSDP FULL_SHARD: shard over every rank
//!   fsdp::shard_grad_op()    ZeRO-2 / FSDP SHARD_GRAD_OP: keep the gathered parameters from
//!                            forward to backward (one all-gather per step, not two)
//!   fsdp::hybrid_shard(8)    HSDP: shard inside groups of 8 ranks, replicate across them
//!   fsdp::hybrid_shard_per_host()   HSDP with a shard group per host (the ranks the
//!                            communicator places on one host: comm/topology.hpp)
//!   fsdp::no_shard()         DDP: every rank holds everything, gradients all-reduced
//!   fsdp::sharding{.shard_size = 8, .reshard_after_forward = false}   any other combination
//!   fsdp::sharding{.reshard_after_forward_to = 8}   hpZ: after forward keep a secondary shard
//!                            over 8 ranks, so backward gathers inside them (FSDP2's
//!                            reshard_after_forward=8, ZeRO++ hpZ)

#include <string>

namespace fsdp {

//! The sharding of a shard_group. Its contract:
//!   1. shard_size is the number of consecutive ranks that share one copy of the parameters
//!      (the shard group); 0 means every rank; per_host means the ranks of one host, which
//!      shard_group requires to be as many on every host and consecutive. shard_group rejects
//!      a size that does not divide the world size. world / shard size groups hold one copy
//!      each (replicas);
//!   2. reshard_after_forward frees the gathered parameters after a unit's forward, so they
//!      are gathered again for its backward; false keeps them (ZeRO-2).
//!   3. reshard_after_forward_to = k (0: off) keeps instead, from a unit's forward to its
//!      backward, a secondary shard of the gathered parameters over each run of k consecutive
//!      ranks of the shard group (1/k of them per rank), so the backward all-gather runs inside
//!      those k ranks (one host's, say) and not across the shard group. shard_group requires
//!      reshard_after_forward and 1 < k < shard size, k dividing it.
struct sharding {
  static constexpr int per_host = -1;  //!< shard_size: the ranks of one host
  int shard_size = 0;
  bool reshard_after_forward = true;
  int reshard_after_forward_to = 0;

  //! Ranks in one shard group for a world of `world` ranks, `ranks_per_host` on each host
  //! (topology::ranks_per_host(); 0: unknown, taken as one host).
  int shard_group_size(int world, int ranks_per_host = 0) const noexcept {
    if (shard_size == per_host) return ranks_per_host > 0 ? ranks_per_host : world;
    return shard_size == 0 ? world : shard_size;
  }
  friend bool operator==(const sharding&, const sharding&) = default;
};

inline sharding full_shard() { return {}; }
inline sharding shard_grad_op() { return {.shard_size = 0, .reshard_after_forward = false}; }
inline sharding hybrid_shard(int shard_size) { return {.shard_size = shard_size}; }
inline sharding hybrid_shard_per_host() { return {.shard_size = sharding::per_host}; }
inline sharding no_shard() { return {.shard_size = 1, .reshard_after_forward = false}; }

//! The factory that makes `s` ("full_shard()", "hybrid_shard(8)", ...), else its fields.
inline std::string to_string(const sharding& s) {
  if (s == full_shard()) return "full_shard()";
  if (s == shard_grad_op()) return "shard_grad_op()";
  if (s == no_shard()) return "no_shard()";
  if (s == hybrid_shard_per_host()) return "hybrid_shard_per_host()";
  if (s.shard_size > 0 && s.reshard_after_forward && s.reshard_after_forward_to == 0) return "hybrid_shard(" + std::to_string(s.shard_size) + ")";
  std::string out = "sharding{.shard_size = " + std::to_string(s.shard_size) +
                    ", .reshard_after_forward = " + (s.reshard_after_forward ? "true" : "false");
  if (s.reshard_after_forward_to != 0) out.append(", .reshard_after_forward_to = ").append(std::to_string(s.reshard_after_forward_to));
  return out + "}";
}

}  // namespace fsdp
