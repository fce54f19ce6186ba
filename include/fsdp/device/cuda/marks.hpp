#pragma once
//! \file Points on a CUDA device's clock (device_mark, device/concepts.hpp): timed events,
//! reused per device, that cuda_queue::mark() and cuda_device::compute_mark() record for
//! shard_group::time_on_device (detail/group/device_spans.hpp).

#if !defined(__CUDACC__)
#error "fsdp/device/cuda/marks.hpp needs nvcc: include fsdp/device/cuda.hpp from a CUDA source"
#endif

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include <cuda_runtime_api.h>

#include "fsdp/device/concepts.hpp"
#include "fsdp/device/cuda/waits.hpp"

namespace fsdp::detail {

//! device_mark (device/concepts.hpp) on a CUDA stream: a timed event recorded there.
inline double cuda_ms_between(const void* earlier, const void* later) {
  auto a = static_cast<cudaEvent_t>(const_cast<void*>(earlier)), b = static_cast<cudaEvent_t>(const_cast<void*>(later));
  float ms = 0;
  if (cudaEventQuery(a) != cudaSuccess || cudaEventQuery(b) != cudaSuccess || cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1.0;
  }
  return ms;
}
// Timed events are reused, per device: a step records about four per bucket, and creating and
// destroying each cost 2.5% of the GPT's step at 4 ranks (H200, 2026-11-28). Never freed (a
// process has few), and never destroyed: marks may outlive static destruction.
class timed_events {
 public:
  static cudaEvent_t take(int ordinal) {
    auto& p = instance();
    {
      std::lock_guard lock(p.m_);
      if (static_cast<std::size_t>(ordinal) < p.free_.size() && !p.free_[static_cast<std::size_t>(ordinal)].empty()) {
        cudaEvent_t e = p.free_[static_cast<std::size_t>(ordinal)].back();
        p.free_[static_cast<std::size_t>(ordinal)].pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreate(&e), "cudaEventCreate (timed)");
    return e;
  }
  static void give(int ordinal, cudaEvent_t e) {
    auto& p = instance();
    std::lock_guard lock(p.m_);
    if (p.free_.size() <= static_cast<std::size_t>(ordinal)) p.free_.resize(static_cast<std::size_t>(ordinal) + 1);
    p.free_[static_cast<std::size_t>(ordinal)].push_back(e);
  }

 private:
  static timed_events& instance() {
    static auto* p = new timed_events;  // leaked on purpose (above)
    return *p;
  }
  std::mutex m_;
  std::vector<std::vector<cudaEvent_t>> free_;
};

inline device_mark cuda_mark(cudaStream_t stream, int ordinal) {
  // The marks are read on the host as they complete, which a capture's events never do.
  if (capturing(stream))
    throw error(errc::invalid_argument, "timing on the device (shard_group::time_on_device) inside a CUDA graph capture: its marks "
                                        "are read on the host; time eager steps, and capture a group that does not time");
  cudaEvent_t e = timed_events::take(ordinal);
  device_mark m{std::shared_ptr<void>(e, [ordinal](void* p) { timed_events::give(ordinal, static_cast<cudaEvent_t>(p)); }), &cuda_ms_between};
  cuda_check(cudaEventRecord(e, stream), "cudaEventRecord (timed)");
  return m;
}

}  // namespace fsdp::detail
