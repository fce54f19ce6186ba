#pragma once
//! \file Device memory from an allocator outside fsdp (cuda_device::use_memory): a
//! cuda_memory_source's blocks, kept after their buffers are freed and handed out again in
//! stream order, as fsdp's own pool reuses its blocks. Included by device/cuda/memory.hpp.
//!
//! What it is for: NCCL's zero-copy collectives. NCCL reads and writes a registered buffer
//! directly only when it can export the buffer's memory to its peers, which it asks of the
//! buffer's VMM mapping (cuMemRetainAllocationHandle, NCCL 2.30's transport/p2p.cc); a CUDA
//! memory pool's blocks are mapped by the driver, not by cuMemMap, so fsdp's pool memory cannot
//! be registered that way. comm/nccl/registered_memory.hpp makes a source of ncclMemAlloc's
//! blocks, each registered with a communicator, which is how PyTorch (a MemPool over NCCL's
//! allocator) and Megatron-FSDP (its nccl_ub buffers) give NCCL registered memory.

#if !defined(__CUDACC__)
#error "fsdp/device/cuda/block_cache.hpp needs nvcc: include fsdp/device/cuda.hpp from a CUDA source"
#endif

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/device/cuda/waits.hpp"

namespace fsdp {

//! An allocator of device memory for cuda_device::use_memory.
struct cuda_memory_source {
  std::string name;                                   // names the source in errors
  std::function<void*(std::size_t bytes)> allocate;   // at least `bytes`; throws fsdp::error when it cannot
  std::function<void(void* block)> free;              // takes back what allocate returned; must not throw
};

namespace detail {

//! A cuda_memory_source's blocks. A block released on a stream is handed out again, for the
//! same size only, once the work queued there before the release has run (an event, queried,
//! never waited for): so an allocation never makes the host or a stream wait and is usable by
//! every stream at once, the rule fsdp's pool follows (device/cuda.hpp). A training step asks
//! for the same sizes every step, so after the first the source is not called again; the blocks
//! go back to it when the device does.
class block_cache {
 public:
  explicit block_cache(cuda_memory_source source) : source_(std::move(source)) {
    if (!source_.allocate || !source_.free)
      throw error(errc::invalid_argument, "cuda_device::use_memory: the memory source '" + source_.name + "' needs both allocate and free");
  }
  block_cache(const block_cache&) = delete;
  block_cache& operator=(const block_cache&) = delete;
  //! Returns every block to the source once its last release has run, all within one
  //! default_timeout(). A block whose release has not run by then is left as it is: work that may
  //! still read it must not find it unmapped (which would fail every rank sharing the context).
  ~block_cache() {
    const auto deadline = std::chrono::steady_clock::now() + default_timeout();
    for (block& b : blocks_) {
      bool done = !b.released || b.retired;  // retired: last used by a graph, which the drained compute stream ran
      if (!done) try {
          const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
          cuda_poll([e = b.released] { return cudaEventQuery(e); }, std::max(left, milliseconds{0}), "a cached block's release", {});
          done = true;
        } catch (...) {  // stuck, or a failed device: leave the block mapped
        }
      if (b.released) (void)cudaEventDestroy(b.released);
      if (done) source_.free(b.ptr);
    }
    (void)cudaGetLastError();
  }

  const std::string& name() const noexcept { return source_.name; }

  //! A block of exactly `bytes` whose last release has run, or a new one from the source.
  void* take(std::size_t bytes) {
    std::lock_guard lock(m_);
    for (block& b : blocks_) {
      if (b.live || b.retired || b.bytes != bytes) continue;
      const cudaError_t rc = cudaEventQuery(b.released);
      if (rc == cudaErrorNotReady) continue;
      if (rc != cudaSuccess) throw error(errc::internal, "cudaEventQuery on a cached block's release: " + cuda_error_text(rc));
      b.live = true;
      return b.ptr;
    }
    void* p = source_.allocate(bytes);
    if (!p) throw error(errc::internal, "the memory source '" + source_.name + "' returned no memory for " + std::to_string(bytes) + " bytes");
    try {
      blocks_.push_back({p, bytes});
    } catch (...) {
      source_.free(p);
      throw;
    }
    return p;
  }

  //! `p` (from take) is free once the work queued on `after` so far has run. Released inside a
  //! CUDA graph capture, where no event can be recorded that the host could query, a block is
  //! never handed out again (it goes back to the source with the device).
  void give(void* p, cudaStream_t after) noexcept {
    std::lock_guard lock(m_);
    for (block& b : blocks_) {
      if (b.ptr != p) continue;
      b.live = false;
      if (capturing(after)) {
        b.retired = true;
        return;
      }
      if (!b.released && cudaEventCreateWithFlags(&b.released, cudaEventDisableTiming) != cudaSuccess) b.released = nullptr;
      if (!b.released || cudaEventRecord(b.released, after) != cudaSuccess) {
        b.retired = true;  // no way to know when it is free: keep it out of use
        (void)cudaGetLastError();
      }
      return;
    }
  }

 private:
  struct block {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    bool live = true;
    bool retired = false;
    cudaEvent_t released = nullptr;  // recorded at the block's last release
  };
  cuda_memory_source source_;
  std::mutex m_;
  std::vector<block> blocks_;  // every block the source gave, in use or not (a step's buffers: tens)
};

}  // namespace detail
}  // namespace fsdp
