#pragma once
//! \file ShardingStrategy: who owns which bytes, and so which collectives run.
//!
//!   full_shard{}                                  ZeRO-3 / FSDP FULL_SHARD
//!   full_shard{.reshard_after_forward = false}    ZeRO-2 / FSDP SHARD_GRAD_OP ("grad_op")
//!   hybrid_shard{.shard_size = 8}                 shard inside groups of 8, replicate across
//!   no_shard{}                                    DDP: every rank holds everything

#include <concepts>
#include <string>


namespace fsdp {

enum class sharding_kind { full, hybrid, none };

//! ShardingStrategy. A type T models it when:
//!   1. T::kind is a sharding_kind constant;
//!   2. s.shard_group_size(world_size) returns the number of ranks that share one copy of the
//!      parameters (the shard group; world_size / it replica groups); shard_group rejects a
//!      size that does not divide world_size;
//!   3. s.reshard_after_forward converts to bool: free gathered parameters after forward.
template <class T>
concept sharding_strategy = requires(const T& s, int world) {
  { T::kind } -> std::convertible_to<sharding_kind>;
  { s.shard_group_size(world) } -> std::convertible_to<int>;
  { s.reshard_after_forward } -> std::convertible_to<bool>;
};

//! Shard every unit over all ranks (ZeRO-3); with reshard_after_forward = false, keep the
//! gathered parameters from forward to backward (ZeRO-2: one all-gather per step, not two).
struct full_shard {
  static constexpr sharding_kind kind = sharding_kind::full;
  bool reshard_after_forward = true;
  int shard_group_size(int world) const noexcept { return world; }
  friend bool operator==(const full_shard&, const full_shard&) = default;
};

//! Shard inside groups of shard_size consecutive ranks and replicate across the groups
//! (HSDP): gradients are reduce-scattered inside a group, then all-reduced across groups.
struct hybrid_shard {
  static constexpr sharding_kind kind = sharding_kind::hybrid;
  int shard_size = 0;
  bool reshard_after_forward = true;
  int shard_group_size(int) const noexcept { return shard_size; }
  friend bool operator==(const hybrid_shard&, const hybrid_shard&) = default;
};

//! No sharding (DDP): parameters, gradients and optimizer state replicated on every rank,
//! gradients all-reduced.
struct no_shard {
  static constexpr sharding_kind kind = sharding_kind::none;
  static constexpr bool reshard_after_forward = false;
  int shard_group_size(int) const noexcept { return 1; }
  friend bool operator==(const no_shard&, const no_shard&) = default;
};

static_assert(sharding_strategy<full_shard>);
static_assert(sharding_strategy<hybrid_shard>);
static_assert(sharding_strategy<no_shard>);

inline std::string to_string(const full_shard& s) {
  return s.reshard_after_forward ? "full_shard" : "full_shard{.reshard_after_forward = false}";
}
inline std::string to_string(const hybrid_shard& s) {
  return "hybrid_shard{.shard_size = " + std::to_string(s.shard_size) +
         (s.reshard_after_forward ? "}" : ", .reshard_after_forward = false}");
}
inline std::string to_string(const no_shard&) { return "no_shard"; }

}  // namespace fsdp
