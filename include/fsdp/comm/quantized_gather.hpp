#pragma once
//! \file Quantized all-gathers for shard_group's options.collectives (policy/collectives.hpp):
//! each rank's shard is sent as one byte per element with one float scale per block of
//! elements, as ZeRO++'s quantized weight communication (qwZ) and Megatron-FSDP / FSDP2's fp8
//! weight gathers do, and every rank's chunk is dequantized on arrival.
//!
//!   group_t::options opts;
//!   opts.collectives.all_gather = fsdp::int8_all_gather{};   // or fsdp::fp8_all_gather{}
//!
//! Per gather a rank sends packed_bytes(n) · (S − 1) bytes instead of n · sizeof(param) ·
//! (S − 1): for blocks of 256, 1 + 4/256 bytes per element, 0.254 of f32 and 0.508 of bf16 on
//! large shards (more on small ones, from the padding to 4 bytes and a short last block). The
//! two codes differ in how the byte spends its bits (scale = the block's max|x| / the code's
//! largest value):
//!   int8        round(x / scale), uniform steps: every element within half a step,
//!               max|x| / 127 / 2 (0.4 % of the block's largest value), small values lose most;
//!   fp8 e4m3    CUDA's __nv_fp8_e4m3 (cuda_fp8.h, round to nearest even, saturating at ±448):
//!               3 mantissa bits, every element within 1/16 of its own magnitude (plus
//!               scale · 2^-10 for the subnormals), small values keep their relative precision.
//! This rank's own chunk is dequantized too, so every rank of the shard group computes with the
//! same values. The master shard, the gradients and their reduction stay exact: only the
//! gathered copy is quantized.
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

#include <cuda_fp8.h>  // __nv_fp8_e4m3: the toolkit's e4m3 conversions, host and device

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/device/host.hpp"

namespace fsdp {

//! The one-byte codes of a quantized gather. A code has: `largest` (the largest magnitude a
//! byte holds; a block's scale maps its max|x| there), encode(x / scale) -> byte and
//! decode(byte) -> x / scale.
struct int8_code {
  static constexpr float largest = 127.0f;
  static std::uint8_t encode(float v) {
    return static_cast<std::uint8_t>(static_cast<std::int8_t>(std::clamp(std::nearbyint(v), -127.0f, 127.0f)));
  }
  static float decode(std::uint8_t b) { return static_cast<float>(static_cast<std::int8_t>(b)); }
};
struct fp8_e4m3_code {
  static constexpr float largest = 448.0f;  // e4m3's largest finite value (OCP FP8 spec)
  static std::uint8_t encode(float v) { return __nv_fp8_e4m3(v).__x; }
  static float decode(std::uint8_t b) {
    __nv_fp8_e4m3 f;
    f.__x = b;
    return static_cast<float>(f);
  }
};

namespace detail {

//! Bytes of one rank's packed chunk of n elements: ceil(n / block) float scales, then n bytes
//! padded to 4 (so the next rank's scales stay aligned).
constexpr std::size_t packed_bytes(std::size_t n, std::size_t block) noexcept {
  return (n + block - 1) / block * sizeof(float) + (n + 3) / 4 * 4;
}

//! Packs x[0, n) as per-block scales (max|x| / Code::largest; 0 for a block of zeros) and codes
//! of x / scale, into `out` (packed_bytes(n, block) bytes).
template <class Code, class T>
void quantize(const T* x, std::size_t n, std::size_t block, std::byte* out) {
  const std::size_t blocks = (n + block - 1) / block;
  auto* values = reinterpret_cast<std::uint8_t*>(out + blocks * sizeof(float));
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t lo = b * block, hi = std::min(n, lo + block);
    float amax = 0;
    for (std::size_t i = lo; i < hi; ++i) amax = std::max(amax, std::abs(convert<float>(x[i])));
    const float scale = amax / Code::largest;
    std::memcpy(out + b * sizeof(float), &scale, sizeof(float));
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (std::size_t i = lo; i < hi; ++i) values[i] = Code::encode(convert<float>(x[i]) * inv);
  }
}

//! x[i] = decode(code[i]) · scale of its block, from a chunk quantize packed.
template <class Code, class T>
void dequantize(const std::byte* in, std::size_t n, std::size_t block, T* x) {
  const std::size_t blocks = (n + block - 1) / block;
  const auto* values = reinterpret_cast<const std::uint8_t*>(in + blocks * sizeof(float));
  for (std::size_t b = 0; b < blocks; ++b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
    for (std::size_t i = b * block; i < std::min(n, (b + 1) * block); ++i) x[i] = convert<T>(Code::decode(values[i]) * scale);
  }
}

}  // namespace detail

//! The all-gather of contract 1 of policy/collectives.hpp, over one-byte codes with a float
//! scale per `block` elements. 256 is ZeRO++'s order of group size and keeps the scales at
//! 1.6 % of the bytes.
template <class Code>
struct quantized_all_gather {
  std::size_t block = 256;

  template <class T, class Comm>
  void operator()(T* full, std::size_t n, Comm& shard_group, host_queue& q) const {
    if (block == 0) throw error(errc::invalid_argument, "quantized all-gather: block must be > 0");
    const auto me = static_cast<std::size_t>(shard_group.rank()), size = static_cast<std::size_t>(shard_group.size());
    const std::size_t packed = detail::packed_bytes(n, block), b = block;
    // Every task holds the buffer, so it lives until the last one has run.
    auto buf = std::make_shared<std::vector<std::byte>>(packed * size);
    q.launch([=](auto) { detail::quantize<Code>(full + me * n, n, b, buf->data() + me * packed); });
    shard_group.all_gather(buf->data() + me * packed, buf->data(), packed, dtype::u8, q);
    q.launch([=](auto) {
      for (std::size_t r = 0; r < size; ++r) detail::dequantize<Code>(buf->data() + r * packed, n, b, full + r * n);
    });
  }
};

using int8_all_gather = quantized_all_gather<int8_code>;     //!< ZeRO++ qwZ's uniform int8
using fp8_all_gather = quantized_all_gather<fp8_e4m3_code>;  //!< fp8 e4m3, as float8 weight gathers use

}  // namespace fsdp
