#pragma once
//! \file How shard_group::finalize sets the initial values of the sharded parameters.
//!
//!   group.finalize(fsdp::init::broadcast_from(0));    // rank 0's handles hold the values
//!   group.finalize(fsdp::init::per_shard(fill));      // each rank fills only what it owns
//!
//! per_shard never materializes a full parameter: fill(slice, out) is called for the part of
//! each parameter the rank owns and must write the values of elements [slice.offset,
//! slice.offset + out.size()) of that parameter. A fill that depends only on (unit, index,
//! element) gives the same values as calling it on the whole parameter, so an unsharded
//! reference initialised with the same function starts from identical values.

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>
#include <utility>

namespace fsdp {

//! The part of one parameter a per_shard fill is asked for.
struct param_slice {
  int unit = 0;              //!< unit index
  int index = 0;             //!< parameter index inside the unit
  std::string_view name{};   //!< param_traits name
  std::size_t offset = 0;    //!< first element of the parameter to fill
  std::size_t numel = 0;     //!< elements of the whole parameter
};

namespace init {

//! Take the initial values from the parameter handles of `root` (a world rank); other ranks'
//! handles may hold anything.
struct broadcast_from {
  int root = 0;
};

//! A fill for per_shard: callable as fill(const fsdp::param_slice&, std::span<float> out).
template <class Fill>
concept shard_fill = std::invocable<const Fill&, const param_slice&, std::span<float>>;

template <class Fill>
struct per_shard_t {
  Fill fill;
};

//! Initialise each rank's shard with fill(const param_slice&, std::span<float> out).
template <class Fill>
per_shard_t<Fill> per_shard(Fill fill) {
  static_assert(shard_fill<Fill>,
                "init::per_shard: the fill must be callable as fill(const fsdp::param_slice&, std::span<float> out)");
  return {std::move(fill)};
}

}  // namespace init

namespace detail {
template <class T>
inline constexpr bool is_per_shard = false;
template <class Fill>
inline constexpr bool is_per_shard<init::per_shard_t<Fill>> = init::shard_fill<Fill>;
}  // namespace detail

//! What shard_group::finalize accepts: init::broadcast_from{root}, or init::per_shard(fill)
//! with a fill that models init::shard_fill.
template <class Init>
concept initial_values = std::same_as<Init, init::broadcast_from> || detail::is_per_shard<Init>;
}  // namespace fsdp
