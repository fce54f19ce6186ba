#pragma once
//! \file The global gradient norm on a CUDA device (optim/clip.hpp): each bucket's sum of
//! squares written into device memory by CUB (Thrust's transform_reduce returns its value to the
//! host, synchronizing twice per bucket: 8 waits for 3 buckets, measured on an H200), the parts
//! summed on the device and all-reduced over the shard group in device memory; read once by
//! grad_norm, not at all by clip_on_device. nvcc only (clip.hpp includes it under __CUDACC__).

#include <cub/device/device_reduce.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <cstddef>
#include <string>

#include "fsdp/core/dtype.hpp"
#include "fsdp/detail/kernels.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/device/concepts.hpp"
#include "fsdp/device/cuda.hpp"

namespace fsdp::detail {

// out = reduce(in[0..n)) with CUB on `stream`, its temporary storage from the device's pool
// (freed in stream order). `reduce(temp, bytes)` is the CUB call, run twice as CUB asks.
template <class Reduce>
void cub_reduce(const cuda_device& device, Reduce&& reduce, const char* what) {
  std::size_t bytes = 0;
  cuda_check(reduce(nullptr, bytes), what);
  cuda_buffer temp = device.allocate_uninitialized(bytes > 0 ? bytes : 1, mem_kind::transient);
  cuda_check(reduce(temp.data(), bytes), what);
}

//! The sum over the shard group of every gradient shard's squares (Group::shard(b).grads of
//! numel elements), written to `*total` in the device's memory, in compute order: no host wait.
template <class Group>
void cuda_global_sum_of_squares_into(Group& group, double* total) {
  using master_type = typename Group::master_type;
  const cuda_device& device = group.device();
  const std::size_t buckets = group.num_buckets();
  const cudaStream_t stream = device.compute_stream();
  cuda_buffer parts = device.allocate_uninitialized(buckets * sizeof(double), mem_kind::transient);
  double* part = parts.as<double>();
  for (std::size_t b = 0; b < buckets; ++b) {
    const auto s = group.shard(b);
    cub_reduce(device, [&](void* temp, std::size_t& bytes) {
      return cub::DeviceReduce::TransformReduce(temp, bytes, thrust::counting_iterator<std::size_t>(0), part + b, s.numel,
                                                cuda::std::plus<double>{}, square_op<master_type>{s.grads}, 0.0, stream);
    }, "cub::DeviceReduce::TransformReduce (gradient norm)");
  }
  cub_reduce(device, [&](void* temp, std::size_t& bytes) { return cub::DeviceReduce::Sum(temp, bytes, part, total, buckets, stream); },
             "cub::DeviceReduce::Sum (gradient norm)");
  group.shard_group_sum_in_place(total);
}

//! The same sum, read back: one host wait, for the result.
template <class Group>
double cuda_global_sum_of_squares(Group& group) {
  cuda_buffer total = group.device().allocate_uninitialized(sizeof(double), mem_kind::transient);
  cuda_global_sum_of_squares_into(group, total.as<double>());
  double out = 0;
  group.device().copy_to_host(&out, total.data(), sizeof out);  // the one wait
  return out;
}

}  // namespace fsdp::detail
