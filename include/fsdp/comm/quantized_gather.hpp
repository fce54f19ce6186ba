#pragma once
//! \file int8_all_gather: a custom all-gather for shard_group's options.collectives
//! (policy/collectives.hpp) that sends each rank's shard as int8 values with one float scale per
//! block of elements, as ZeRO++'s quantized weight communication (qwZ) does, and dequantizes every
//! rank's chunk on arrival.
//!
//!   group_t::options opts;
//!   opts.collectives.all_gather = fsdp::int8_all_gather{};   // blocks of 256 elements
//!
//! Per gather a rank sends int8_packed_bytes(n) · (S − 1) bytes instead of n · sizeof(param) ·
//! (S − 1): for blocks of 256, 1 + 4/256 bytes per element, 0.254 of f32 and 0.508 of bf16 on
//! large shards (more on small ones, from the padding to 4 bytes and a short last block).
//! Each element comes back within half a step of its block's scale, max|x| / 127 / 2 (0.4 % of
//! the block's largest value). This rank's own chunk is dequantized too, so every rank of the
//! shard group computes with the same values. The master shard, the gradients and their
//! reduction stay exact: only the gathered copy is quantized.
//!
//! Host device only: the packing buffer is host memory and the loops run on the queue's thread
//! (a CUDA version needs device buffers and kernels; not built).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp {

namespace detail {

//! Bytes of one rank's packed chunk of n elements: ceil(n / block) float scales, then n int8
//! values padded to 4 bytes (so the next rank's scales stay aligned).
constexpr std::size_t int8_packed_bytes(std::size_t n, std::size_t block) noexcept {
  return (n + block - 1) / block * sizeof(float) + (n + 3) / 4 * 4;
}

//! Packs x[0, n) as per-block scales (max|x| / 127; 0 for a block of zeros) and int8 values
//! round(x / scale), into `out` (int8_packed_bytes(n, block) bytes).
template <class T>
void quantize_int8(const T* x, std::size_t n, std::size_t block, std::byte* out) {
  const std::size_t blocks = (n + block - 1) / block;
  auto* values = reinterpret_cast<std::int8_t*>(out + blocks * sizeof(float));
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t lo = b * block, hi = std::min(n, lo + block);
    float amax = 0;
    for (std::size_t i = lo; i < hi; ++i) amax = std::max(amax, std::abs(convert<float>(x[i])));
    const float scale = amax / 127.0f;
    std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (std::size_t i = lo; i < hi; ++i)
      values[i] = static_cast<std::int8_t>(std::clamp(std::nearbyint(convert<float>(x[i]) * inv), -127.0f, 127.0f));
  }
}

//! x[i] = value[i] · scale of its block, from a chunk quantize_int8 packed.
template <class T>
void dequantize_int8(const std::byte* in, std::size_t n, std::size_t block, T* x) {
  const std::size_t blocks = (n + block - 1) / block;
  const auto* values = reinterpret_cast<const std::int8_t*>(in + blocks * sizeof(float));
  for (std::size_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
    for (std::size_t i = b * block; i < std::min(n, (b + 1) * block); ++i) x[i] = convert<T>(static_cast<float>(values[i]) * scale);
  }
}

}  // namespace detail

//! The all-gather of contract 1 of policy/collectives.hpp, over int8 with a scale per `block`
//! elements. 256 is ZeRO++'s order of group size and keeps the scales at 1.6 % of the bytes.
struct int8_all_gather {
  std::size_t block = 256;

  template <class T, class Comm>
  void operator()(T* full, std::size_t n, Comm& shard_group, host_queue& q) const {
    if (block == 0) throw error(errc::invalid_argument, "int8_all_gather: block must be > 0");
    const auto me = static_cast<std::size_t>(shard_group.rank()), size = static_cast<std::size_t>(shard_group.size());
    const std::size_t packed = detail::int8_packed_bytes(n, block), b = block;
    // Every task holds the buffer, so it lives until the last one has run.
    auto buf = std::make_shared<std::vector<std::byte>>(packed * size);
    q.launch([=](auto) { detail::quantize_int8(full + me * n, n, b, buf->data() + me * packed); });
    shard_group.all_gather(buf->data() + me * packed, buf->data(), packed, dtype::u8, q);
    q.launch([=](auto) {
      for (std::size_t r = 0; r < size; ++r) detail::dequantize_int8(buf->data() + r * packed, n, b, full + r * n);
    });
  }
};

}  // namespace fsdp
