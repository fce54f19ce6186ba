#pragma once
//! \file Element-wise kernels written once with Thrust: the host device runs them with
//! thrust::cpp::par, a CUDA device with thrust::cuda::par.on(stream).

#include <cstddef>

#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform_reduce.h>

#include "fsdp/core/config.hpp"
#include "fsdp/core/dtype.hpp"

namespace fsdp::detail {

template <class Policy, class F>
void for_each_index(const Policy& policy, std::size_t n, F f) {
  thrust::for_each_n(policy, thrust::counting_iterator<std::size_t>(0), n, f);
}

template <class To, class From>
struct cast_op {
  To* dst;
  const From* src;
  FSDP_HOST_DEVICE void operator()(std::size_t i) const { dst[i] = convert<To>(src[i]); }
};

//! dst[i] = src[i] converted to To.
template <class To, class From, class Policy>
void cast(const Policy& policy, To* dst, const From* src, std::size_t n) {
  for_each_index(policy, n, cast_op<To, From>{dst, src});
}

template <class To, class From>
struct add_op {
  To* dst;
  const From* src;
  FSDP_HOST_DEVICE void operator()(std::size_t i) const {
    dst[i] = convert<To>(convert<float>(dst[i]) + convert<float>(src[i]));
  }
};

//! dst[i] += src[i], added in float.
template <class To, class From, class Policy>
void accumulate(const Policy& policy, To* dst, const From* src, std::size_t n) {
  for_each_index(policy, n, add_op<To, From>{dst, src});
}

template <class T>
struct square_op {
  const T* x;
  FSDP_HOST_DEVICE double operator()(std::size_t i) const {
    const double v = convert<double>(x[i]);
    return v * v;
  }
};

//! Sum of squares, accumulated in double.
template <class T, class Policy>
double sum_of_squares(const Policy& policy, const T* x, std::size_t n) {
  return thrust::transform_reduce(policy, thrust::counting_iterator<std::size_t>(0),
                                  thrust::counting_iterator<std::size_t>(n), square_op<T>{x}, 0.0,
                                  thrust::plus<double>());
}

template <class T>
struct nonfinite_index_op {
  const T* x;
  std::size_t n;
  FSDP_HOST_DEVICE std::size_t operator()(std::size_t i) const {
    const double v = convert<double>(x[i]);
    return v - v == 0.0 ? n : i;  // nan and inf, less themselves, give nan
  }
};

//! The index of x's first nan or inf; n when every element is finite.
template <class T, class Policy>
std::size_t first_nonfinite(const Policy& policy, const T* x, std::size_t n) {
  return thrust::transform_reduce(policy, thrust::counting_iterator<std::size_t>(0),
                                  thrust::counting_iterator<std::size_t>(n), nonfinite_index_op<T>{x, n}, n,
                                  thrust::minimum<std::size_t>());
}

template <class T>
struct scale_op {
  T* x;
  float s;
  FSDP_HOST_DEVICE void operator()(std::size_t i) const { x[i] = convert<T>(convert<float>(x[i]) * s); }
};

//! x[i] *= s.
template <class T, class Policy>
void scale(const Policy& policy, T* x, std::size_t n, float s) {
  for_each_index(policy, n, scale_op<T>{x, s});
}

}  // namespace fsdp::detail
