#pragma once
//! \file cuda_device::use_memory's cache (device/block_cache.hpp) on CUDA: a block's release is
//! a CUDA event recorded on the stream that freed it, and it is reusable once the event has
//! completed. Included by device/cuda/memory.hpp.
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

#include <cuda_runtime_api.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/device/block_cache.hpp"
#include "fsdp/device/cuda/waits.hpp"

namespace fsdp {

//! An allocator of device memory for cuda_device::use_memory.
using cuda_memory_source = memory_source;

namespace detail {

//! block_cache's marks on CUDA: events (cudaEventDisableTiming), asked with cudaEventQuery.
struct cuda_release_marks {
  using stream = cudaStream_t;
  using mark = cudaEvent_t;
  static mark create() noexcept {
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return e;
  }
  static bool record(mark e, stream s) noexcept {
    if (cudaEventRecord(e, s) == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
  }
  // Inside a capture a record becomes a node of the graph, which the host cannot ask about.
  static bool capturing(stream s) noexcept { return detail::capturing(s); }
  static bool done(mark e) {
    const cudaError_t rc = cudaEventQuery(e);
    if (rc == cudaSuccess) return true;
    if (rc == cudaErrorNotReady) return false;
    throw error(errc::internal, "cudaEventQuery on a cached block's release: " + cuda_error_text(rc));
  }
  static bool wait(mark e, milliseconds timeout) noexcept {
    try {
      cuda_poll([e] { return cudaEventQuery(e); }, timeout, "a cached block's release", {});
      return true;
    } catch (...) {  // stuck, or a failed device
      return false;
    }
  }
  static void destroy(mark e) noexcept {
    (void)cudaEventDestroy(e);
    (void)cudaGetLastError();
  }
};

using cuda_block_cache = block_cache<cuda_release_marks>;

}  // namespace detail
}  // namespace fsdp
