#pragma once
//! \file Element types: f32, bf16 and f16 are sharded; f64 and bytes serve bookkeeping.
//! bf16 and f16 are CUDA's own `__nv_bfloat16` and `__half` (from the toolkit headers), which
//! also work on the host under g++, so the same buffers move between host and GPU code.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fsdp/core/config.hpp"

namespace fsdp {

using bf16 = __nv_bfloat16;  //!< brain float 16 (8-bit exponent, 7-bit mantissa)
using f16 = __half;          //!< IEEE half precision

//! Runtime tag of an element type. A framework may report any of these for its parameters;
//! only f32, bf16 and f16 can be sharded (see is_shardable).
enum class dtype : std::uint8_t { f32, bf16, f16, f64, i32, i64, u8 };

constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return 4;
    case dtype::bf16: return 2;
    case dtype::f16: return 2;
    case dtype::f64: return 8;
    case dtype::i32: return 4;
    case dtype::i64: return 8;
    case dtype::u8: return 1;
  }
  return 0;
}

constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::bf16: return "bf16";
    case dtype::f16: return "f16";
    case dtype::f64: return "f64";
    case dtype::i32: return "i32";
    case dtype::i64: return "i64";
    case dtype::u8: return "u8";
  }
  return "?";
}

//! Parameters, gradients and their shards may have these types.
constexpr bool is_shardable(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16;
}
//! Collectives can sum and average these types.
constexpr bool is_reducible(dtype t) noexcept { return is_shardable(t) || t == dtype::f64; }

namespace detail {
template <class T> struct dtype_of_impl {};
template <> struct dtype_of_impl<float> { static constexpr dtype value = dtype::f32; };
template <> struct dtype_of_impl<double> { static constexpr dtype value = dtype::f64; };
template <> struct dtype_of_impl<bf16> { static constexpr dtype value = dtype::bf16; };
template <> struct dtype_of_impl<f16> { static constexpr dtype value = dtype::f16; };
template <> struct dtype_of_impl<std::int32_t> { static constexpr dtype value = dtype::i32; };
template <> struct dtype_of_impl<std::int64_t> { static constexpr dtype value = dtype::i64; };
template <> struct dtype_of_impl<std::uint8_t> { static constexpr dtype value = dtype::u8; };
}  // namespace detail

//! True for the C++ types that have a dtype tag.
template <class T>
concept element_type = requires { detail::dtype_of_impl<std::remove_cv_t<T>>::value; };

//! The dtype tag of a C++ element type: dtype_of<bf16> == dtype::bf16.
template <element_type T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

//! True for the C++ types fsdp can shard: float, bf16, f16.
template <class T>
concept shardable_type = element_type<T> && is_shardable(dtype_of<T>);

//! Converts between element types through float (or double). Rounds to nearest even, as
//! CUDA's conversion intrinsics do, with a single rounding (double -> bf16 does not go via float).
template <class To, class From>
FSDP_HOST_DEVICE inline To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<From, bf16>) {
    return convert<To>(__bfloat162float(x));
  } else if constexpr (std::is_same_v<From, f16>) {
    return convert<To>(__half2float(x));
  } else if constexpr (std::is_same_v<To, bf16>) {
    // A double (or an int above 2^24) must round once: through float it would round twice.
    if constexpr (std::is_same_v<From, float>) return __float2bfloat16(x);
    else return __double2bfloat16(static_cast<double>(x));
  } else if constexpr (std::is_same_v<To, f16>) {
    if constexpr (std::is_same_v<From, float>) return __float2half(x);
    else return __double2half(static_cast<double>(x));
  } else {
    return static_cast<To>(x);
  }
}

//! Calls f(T{}) with T the C++ type of a floating dtype (f32, bf16, f16, f64); returns false
//! and does not call f for other dtypes.
template <class F>
bool visit_floating(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: f(float{}); return true;
    case dtype::bf16: f(bf16{}); return true;
    case dtype::f16: f(f16{}); return true;
    case dtype::f64: f(double{}); return true;
    default: return false;
  }
}

}  // namespace fsdp
