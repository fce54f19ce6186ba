#pragma once
//! \file The one summation order of the host backends' reductions (threads and mpi).
//!
//! reduce_scatter and all_reduce add the ranks' inputs element by element in rank order,
//! ((x0 + x1) + x2) + ..., in float (double for f64), scale the sum by 1/n for reduce_op::avg
//! (a multiplication by the rounded 1/n, in the same precision), and round to the reduce dtype
//! once. Floating-point addition is not associative, so a ring or tree (MPI's own algorithms
//! pick one by message size and rank count) gives other bits from four ranks on; the threads and
//! mpi backends both call this function on the same inputs, so a run gives the same bits on
//! either backend, at any rank count. NCCL sums in its own ring/tree order (comm/nccl.hpp).

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "fsdp/comm/concepts.hpp"
#include "fsdp/core/dtype.hpp"

namespace fsdp::detail {

//! dst[i] = round_t(scale * (((src[0][i] + src[1][i]) + src[2][i]) + ...)) for i < count, where
//! src holds n pointers to `count` elements of `t` and scale is 1 (sum) or 1/n (avg). `dst` may
//! alias one of the sources (each block of elements is read from every source before written).
inline void sum_in_rank_order(void* dst, const void* const* src, int n, std::size_t count, dtype t, reduce_op op) {
  visit_floating(t, [&](auto tag) {
    using T = decltype(tag);
    using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const acc_t scale = op == reduce_op::avg ? acc_t(1) / static_cast<acc_t>(n) : acc_t(1);
    T* out = static_cast<T*>(dst);
    const auto source = [&](int r) { return static_cast<const T*>(src[r]); };
    // f32 and f64 add in their own type, so the sum can run in dst itself: src[0] copied in
    // (memcpy's wide, streaming stores), then each later source added in place, the scale
    // folded into the last pass. One pass fewer than the blocks below, the same bits: the
    // threads reduce-scatter went from 0.49-0.55 to 0.76-0.84 of a plain summing loop at 1 MiB
    // on 2 ranks (fsdp_bench, docs/benchmarks.md). Not when dst is a later source: that would
    // be overwritten before it is read.
    if constexpr (std::is_same_v<T, acc_t>) {
      bool dst_is_later_source = false;
      for (int r = 1; r < n; ++r) dst_is_later_source |= static_cast<const void*>(out) == src[r];
      if (!dst_is_later_source) {
        if (count > 0 && static_cast<const void*>(out) != src[0]) std::memcpy(out, src[0], count * sizeof(T));  // (memcpy of null: UB)
        for (int r = 1; r < n; ++r) {
          const T* s = source(r);
          if (r + 1 == n && scale != acc_t(1))
            for (std::size_t i = 0; i < count; ++i) out[i] = (out[i] + s[i]) * scale;
          else
            for (std::size_t i = 0; i < count; ++i) out[i] += s[i];
        }
        return;  // (n == 1: scale is 1)
      }
    }
    // bf16/f16 (or dst a later source): blocks keep a float accumulator in L1 while each source
    // streams through once, rounded to T once at the end.
    constexpr std::size_t block = 2048;
    acc_t acc[block];
    for (std::size_t b = 0; b < count; b += block) {
      const std::size_t m = std::min(block, count - b);
      const T* first = source(0) + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] = convert<acc_t>(first[i]);
      for (int r = 1; r < n; ++r) {
        const T* s = source(r) + b;
        for (std::size_t i = 0; i < m; ++i) acc[i] += convert<acc_t>(s[i]);
      }
      T* d = out + b;
      for (std::size_t i = 0; i < m; ++i) d[i] = convert<T>(acc[i] * scale);
    }
  });
}

}  // namespace fsdp::detail
