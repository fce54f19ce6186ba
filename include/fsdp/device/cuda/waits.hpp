#pragma once
//! \file What the CUDA device's parts share (device/cuda.hpp includes it): CUDA errors as
//! fsdp::error, the current device, the memory probe, NVTX ranges, and the bounded host waits
//! (cuda_poll), with the watchers communicators attach to them and the count of those waits.

#if !defined(__CUDACC__)
#error "fsdp/device/cuda/waits.hpp needs nvcc: include fsdp/device/cuda.hpp from a CUDA source"
#endif

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include "fsdp/core/backoff.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

namespace detail {

//! "cudaErrorX (text)", and clears the error so that later calls do not report it again.
inline std::string cuda_error_text(cudaError_t e) {
  (void)cudaGetLastError();
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

//! Throws fsdp::error(code) naming `what` unless `e` is cudaSuccess.
inline void cuda_check(cudaError_t e, std::string_view what, errc code = errc::internal) {
  if (e != cudaSuccess) throw error(code, std::string(what) + " failed: " + cuda_error_text(e));
}

//! Makes `ordinal` the calling thread's current device (cheap when it already is).
inline void cuda_use(int ordinal) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == ordinal) return;
  cuda_check(cudaSetDevice(ordinal), "cudaSetDevice(" + std::to_string(ordinal) + ")");
}

//! True while `stream` is being captured into a CUDA graph (device/cuda/graph.hpp): work issued
//! on it then becomes nodes of the graph instead of running, and the host cannot wait for it. A
//! capture that a call invalidated is still one until it ends: fsdp's refusals then name the
//! capture, where its eager paths would fail on the invalidated stream with another error.
inline bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

//! The one rule by which every CUDA backend (comm/nccl/, comm/threads/cuda_communicator.hpp)
//! decides whether a collective uses a buffer in place: true for device or managed memory, and
//! for nullptr (a count of 0 reads nothing); false for host memory, pageable or pinned, which
//! the backends stage through device memory. Pinned host memory is staged too: NCCL documents
//! its buffers as device memory, and one rule keeps the two backends' paths alike.
inline bool device_resident(const void* p) {
  if (!p) return true;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // without a GPU, or a pointer CUDA does not know: host memory
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

//! An NVTX range for profilers (Nsight Systems); costs a few ns when no tool is attached.
class nvtx_range {
 public:
  explicit nvtx_range(const char* name) noexcept { nvtxRangePushA(name); }
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;
  ~nvtx_range() { nvtxRangePop(); }
};

//! Something a wait on a CUDA event must also watch: a communicator whose failures surface
//! only through a host-side query (NCCL's ncclCommGetAsyncError), and which must be aborted
//! for its kernels to stop when a wait gives up.
class wait_watcher {
 public:
  virtual ~wait_watcher() = default;
  //! Throws fsdp::error when the watched object failed (after aborting it).
  virtual void check(std::string_view what) = 0;
  //! The deadline of a wait on `what` passed: abort, and return a sentence for the error.
  virtual std::string abort_on_timeout(std::string_view what) noexcept = 0;
};

//! The watchers a stream has waited on (weak: a watcher gone is no longer of interest).
class watch_list {
 public:
  void add(const std::shared_ptr<wait_watcher>& w) {
    if (!w) return;
    std::lock_guard lock(m_);
    std::erase_if(list_, [](const auto& x) { return x.expired(); });
    for (const auto& x : list_)
      if (x.lock() == w) return;
    list_.push_back(w);
  }
  std::vector<std::shared_ptr<wait_watcher>> get() const {
    std::lock_guard lock(m_);
    std::vector<std::shared_ptr<wait_watcher>> out;
    for (const auto& x : list_)
      if (auto s = x.lock()) out.push_back(std::move(s));
    return out;
  }

 private:
  mutable std::mutex m_;
  std::vector<std::weak_ptr<wait_watcher>> list_;
};

//! Polls query() (cudaEventQuery or cudaStreamQuery) until it reports completion, checking the
//! watchers as it goes. Throws errc::timeout after `timeout` (aborting the watchers first),
//! errc::internal on a CUDA error, or whatever a watcher throws.
//! Host waits fsdp made on this process's GPUs (every cuda_poll), for cuda_host_waits().
inline std::atomic<long> host_wait_count{0};

template <class Query>
void cuda_poll(Query query, std::chrono::milliseconds timeout, std::string_view what,
               const std::vector<std::shared_ptr<wait_watcher>>& watchers) {
  host_wait_count.fetch_add(1, std::memory_order_relaxed);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  backoff idle = backoff::device_wait();
  for (;;) {
    const cudaError_t rc = query();
    if (rc == cudaSuccess) return;
    if (rc == cudaErrorStreamCaptureUnsupported || rc == cudaErrorStreamCaptureInvalidated || rc == cudaErrorStreamCaptureImplicit)
      throw error(errc::invalid_argument, "waiting for " + std::string(what) +
                                              " inside a CUDA graph capture: captured work cannot make the host wait (" +
                                              cuda_error_text(rc) + ")");
    if (rc != cudaErrorNotReady) throw error(errc::internal, "waiting for " + std::string(what) + ": " + cuda_error_text(rc));
    for (const auto& w : watchers) w->check(what);
    if (std::chrono::steady_clock::now() > deadline) {
      std::string aborted;
      for (const auto& w : watchers) aborted += "; " + w->abort_on_timeout(what);
      throw error(errc::timeout, "waited " + std::to_string(timeout.count()) + " ms for " + std::string(what) + aborted);
    }
    idle.pause();
  }
}

}  // namespace detail

//! How many times fsdp has made the host wait for a GPU in this process (every bounded wait:
//! event and stream waits, copies, fills, zeroed allocations). Read it around a step to check
//! that the step has none (tests/cuda/test_nccl_ranks.cu; docs/gpu.md).
inline long cuda_host_waits() noexcept { return detail::host_wait_count.load(std::memory_order_relaxed); }

}  // namespace fsdp
