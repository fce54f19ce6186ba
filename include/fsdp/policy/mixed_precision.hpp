#pragma once
//! \file MixedPrecision: the dtypes of the gathered parameters, of the gradient reduction and
//! of the sharded master copy the optimizer updates.
//!
//!   full_precision<float>                      f32 everywhere
//!   mixed_precision<bf16, float, float>        bf16 compute and all-gather, f32 reduce, f32 master
//!   mixed_precision<bf16, bf16, float>         also reduce in bf16 (half the reduce traffic)

#include <string>
#include <type_traits>

#include "fsdp/core/dtype.hpp"

namespace fsdp {

//! MixedPrecision. A type T models it when:
//!   1. T::param_type is the dtype of gathered parameters and of the gradients the framework
//!      writes (f32, bf16 or f16);
//!   2. T::reduce_type is the dtype gradients are reduced in (f32, bf16 or f16);
//!   3. T::master_type is the dtype of the sharded master parameters and gradient shards.
template <class T>
concept mixed_precision_policy = requires {
  typename T::param_type;
  typename T::reduce_type;
  typename T::master_type;
} && shardable_type<typename T::param_type> && shardable_type<typename T::reduce_type> &&
    shardable_type<typename T::master_type>;

template <class Param, class Reduce = float, class Master = float>
struct mixed_precision {
  static_assert(shardable_type<Param> && shardable_type<Reduce> && shardable_type<Master>,
                "mixed_precision: every dtype must be float, fsdp::bf16 or fsdp::f16");
  using param_type = Param;
  using reduce_type = Reduce;
  using master_type = Master;
  friend bool operator==(const mixed_precision&, const mixed_precision&) = default;
};

//! One dtype for parameters, reduction and master copy.
template <class T>
using full_precision = mixed_precision<T, T, T>;

//! What shard_group reads from a MixedPrecision, worked out once and read by name.
template <mixed_precision_policy P>
struct precision_rules {
  //! Gradients are cast into a reduce-dtype buffer before the reduction (one more transient
  //! buffer per reduction in flight).
  static constexpr bool reduce_dtype_differs = !std::is_same_v<typename P::param_type, typename P::reduce_type>;
  //! With one rank per shard group and the same param and master dtype, the master shard is
  //! the whole parameter in the gathered dtype: the gathered storage is the master itself (no
  //! all-gather buffer, nothing to free).
  static constexpr bool master_aliases_gathered(int shard_size) noexcept {
    return shard_size == 1 && std::is_same_v<typename P::param_type, typename P::master_type>;
  }
};

static_assert(mixed_precision_policy<full_precision<float>>);
static_assert(mixed_precision_policy<mixed_precision<bf16, float, float>>);

template <class P, class R, class M>
std::string to_string(const mixed_precision<P, R, M>&) {
  return "mixed_precision<" + std::string(to_string(dtype_of<P>)) + ", " +
         std::string(to_string(dtype_of<R>)) + ", " + std::string(to_string(dtype_of<M>)) + ">";
}

}  // namespace fsdp
