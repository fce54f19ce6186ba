#pragma once
//! \file The CUDA device's memory (fsdp/device/cuda.hpp, whose file comment describes the
//! allocation rules): the state that copies of one cuda_device share (streams, fsdp's memory
//! pool or an outside source's cached blocks, counters, watchers) and cuda_buffer, bytes from
//! there counted against the device's memory_stats and freed stream-ordered. Included by cuda.hpp.

#if !defined(__CUDACC__)
#error "fsdp/device/cuda/memory.hpp needs nvcc: include fsdp/device/cuda.hpp from a CUDA source"
#endif

#include <atomic>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/device/concepts.hpp"
#include "fsdp/device/cuda/block_cache.hpp"
#include "fsdp/device/cuda/waits.hpp"

namespace fsdp {

namespace detail {
//! Thrust's temporary storage (for reductions) from the device's pool, stream-ordered on the
//! compute stream: Thrust's default is cudaMalloc and cudaFree, and cudaFree waits for every
//! stream of the device. (Not counted in memory_stats: a few bytes per reduction, freed at once.)
struct thrust_pool_allocator {
  using value_type = char;
  cudaMemPool_t pool = nullptr;
  cudaStream_t stream = nullptr;
  char* allocate(std::ptrdiff_t bytes) {
    void* p = nullptr;
    cuda_check(cudaMallocFromPoolAsync(&p, static_cast<std::size_t>(bytes), pool, stream), "Thrust's temporary storage (cudaMallocFromPoolAsync)");
    return static_cast<char*>(p);
  }
  void deallocate(char* p, std::size_t) noexcept {
    if (cudaFreeAsync(p, stream) != cudaSuccess) (void)cudaGetLastError();
  }
};

//! What copies of one cuda_device share.
struct cuda_device_state {
  int ordinal = 0;
  cudaStream_t compute = nullptr;
  cudaStream_t alloc = nullptr;  // allocations are zeroed here (see the file comment)
  cudaMemPool_t pool = nullptr;
  std::unique_ptr<cuda_block_cache> source;  // use_memory's blocks, outside captures; else the pool
  memory_counter memory;
  watch_list watched;  // watchers of events the compute stream waited on
  thrust_pool_allocator thrust_alloc;  // execution_policy()'s temporary storage
  std::atomic<long> graph_owned{0};  // buffers allocated inside a capture and not yet freed inside one

  cuda_device_state() = default;
  cuda_device_state(const cuda_device_state&) = delete;
  cuda_device_state& operator=(const cuda_device_state&) = delete;
  ~cuda_device_state() {
    if (compute) {
      // Frees queued on the stream must run before it goes; a stuck stream is left behind.
      try {
        cuda_poll([s = compute] { return cudaStreamQuery(s); }, default_timeout(), "compute stream teardown", {});
      } catch (...) {
      }
      (void)cudaStreamDestroy(compute);
    }
    source.reset();  // its blocks go back once their last releases have run
    if (alloc) (void)cudaStreamDestroy(alloc);
    // Deferred by the driver until the last block (possibly freed on a queue's stream) is back.
    if (pool) (void)cudaMemPoolDestroy(pool);
    (void)cudaGetLastError();
  }
};

}  // namespace detail

//! Bytes on a cuda_device, counted against its memory_stats. Move-only. The memory is freed
//! stream-ordered: on the compute stream by reset(), on a queue's stream by queue.release().
class cuda_buffer {
 public:
  cuda_buffer() = default;
  //! Usable by any stream on return (see the file comment); zero-filled unless `zeroed` is false.
  //! While the compute stream is captured into a CUDA graph: a node of the graph on `first_use`
  //! (the compute stream when null), usable by the work ordered after it (allocate_in_capture).
  cuda_buffer(std::size_t bytes, mem_kind kind, std::shared_ptr<detail::cuda_device_state> dev, bool zeroed = true,
              cudaStream_t first_use = nullptr)
      : bytes_(bytes), kind_(kind), dev_(std::move(dev)) {
    if (bytes_ == 0) return;
    detail::cuda_use(dev_->ordinal);
    if (detail::capturing(dev_->compute)) {
      allocate_in_capture(first_use ? first_use : dev_->compute, zeroed);
      return;
    }
    if (kind_ == mem_kind::offloaded) {  // pinned host memory (policy/offload.hpp); devices reach it over the bus
      const cudaError_t rc = cudaMallocHost(&ptr_, bytes_);
      if (rc != cudaSuccess) {
        ptr_ = nullptr;
        throw error(errc::internal, "allocating " + std::to_string(bytes_) + " bytes of pinned host memory for offloaded state failed: " +
                                        detail::cuda_error_text(rc));
      }
      std::memset(ptr_, 0, bytes_);
      dev_->memory.add(bytes_, kind_);
      return;
    }
    const auto failed = [&](const std::string& why, errc code = errc::internal) {
      ptr_ = nullptr;
      const memory_stats s = dev_->memory.get();
      return error(code, "allocating " + std::to_string(bytes_) + " bytes on CUDA device " + std::to_string(dev_->ordinal) +
                             " (fsdp holds " + std::to_string(s.live) + " bytes there) failed: " + why);
    };
    if (dev_->source) {
      try {
        ptr_ = dev_->source->take(bytes_);
      } catch (const error& e) {  // its own code: a communicator's abort stays a peer failure
        throw failed("the memory source '" + dev_->source->name() + "': " + e.what(), e.code());
      } catch (const std::exception& e) {
        throw failed("the memory source '" + dev_->source->name() + "': " + e.what());
      }
      from_source_ = true;
    } else if (const cudaError_t rc = cudaMallocFromPoolAsync(&ptr_, bytes_, dev_->pool, dev_->alloc); rc != cudaSuccess) {
      throw failed(detail::cuda_error_text(rc));
    }
    dev_->memory.add(bytes_, kind_);
    if (!zeroed) return;  // nothing queued: no wait (the pool's blocks have no pending work)
    // Padding must read as zero, as on the host device.
    const cudaError_t z = cudaMemsetAsync(ptr_, 0, bytes_, dev_->alloc);
    if (z != cudaSuccess) {
      const std::string text = detail::cuda_error_text(z);
      release_on(dev_->alloc);
      throw error(errc::internal, "cudaMemsetAsync of a new buffer failed: " + text);
    }
    try {
      detail::cuda_poll([s = dev_->alloc] { return cudaStreamQuery(s); }, default_timeout(), "zeroing a new buffer", {});
    } catch (...) {
      release_on(dev_->alloc);
      throw;
    }
  }
  cuda_buffer(cuda_buffer&& o) noexcept { swap(o); }
  cuda_buffer& operator=(cuda_buffer&& o) noexcept {
    cuda_buffer(std::move(o)).swap(*this);
    return *this;
  }
  ~cuda_buffer() { reset(); }

  //! Frees after the work queued so far on the compute stream.
  void reset() noexcept {
    if (ptr_) release_on(dev_->compute);
  }
  //! Frees after the work queued so far on `stream` (which must be ordered after every other
  //! use of the buffer).
  void release_on(cudaStream_t stream) noexcept {
    if (ptr_ && kind_ == mem_kind::offloaded) {
      // Pinned host memory has no stream-ordered free: wait for the stream's use of it first.
      if (cudaStreamSynchronize(stream) != cudaSuccess || cudaFreeHost(ptr_) != cudaSuccess) (void)cudaGetLastError();
      dev_->memory.remove(bytes_, kind_);
    } else if (ptr_) {
      // Inside the capture, graph-owned memory gets its free node (each launch frees it again).
      if (graph_owned_ && detail::capturing(stream)) dev_->graph_owned.fetch_sub(1, std::memory_order_relaxed);
      if (from_source_) dev_->source->give(ptr_, stream);
      else if (cudaFreeAsync(ptr_, stream) != cudaSuccess) (void)cudaGetLastError();
      dev_->memory.remove(bytes_, kind_);
    }
    ptr_ = nullptr;
    bytes_ = 0;
    graph_owned_ = false;
    from_source_ = false;
  }
  void* data() const noexcept { return ptr_; }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  void swap(cuda_buffer& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(kind_, o.kind_);
    std::swap(dev_, o.dev_);
    std::swap(graph_owned_, o.graph_owned_);
    std::swap(from_source_, o.from_source_);
  }
  // Inside a capture (cuda_graph::capture): an allocation node of the graph, on the stream
  // that uses the buffer first, which must be in the capture already (it waited on an event of
  // the captured work), so that the node comes before every use; zeroed by a memset node there.
  // The graph owns the memory: each launch allocates it, at the same address, and the free node
  // that release_on() adds inside the capture returns it, so buffers made and freed in a step
  // reuse memory as the eager step's do. A launch must free what it allocated (cuda_graph
  // counts these buffers); pinned host memory has no graph node.
  void allocate_in_capture(cudaStream_t stream, bool zeroed) {
    const std::string what = "allocating " + std::to_string(bytes_) + " bytes inside a CUDA graph capture";
    if (kind_ == mem_kind::offloaded)
      throw error(errc::invalid_argument, what + ": offloaded state is pinned host memory, which a graph cannot allocate");
    if (!detail::capturing(stream))
      throw error(errc::invalid_argument, what + " for a stream outside the capture (it has not waited on the captured work)");
    const cudaError_t rc = cudaMallocFromPoolAsync(&ptr_, bytes_, dev_->pool, stream);
    if (rc != cudaSuccess) {
      ptr_ = nullptr;
      throw error(errc::internal, what + " failed: " + detail::cuda_error_text(rc));
    }
    graph_owned_ = true;
    dev_->graph_owned.fetch_add(1, std::memory_order_relaxed);
    dev_->memory.add(bytes_, kind_);
    if (!zeroed) return;
    const cudaError_t z = cudaMemsetAsync(ptr_, 0, bytes_, stream);
    if (z != cudaSuccess) {
      const std::string text = detail::cuda_error_text(z);
      release_on(stream);
      throw error(errc::internal, what + ": cudaMemsetAsync failed: " + text);
    }
  }
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  mem_kind kind_ = mem_kind::transient;
  std::shared_ptr<detail::cuda_device_state> dev_;
  bool graph_owned_ = false;
  bool from_source_ = false;  // a block of cuda_device::use_memory's source, not of the pool
};
static_assert(device_buffer<cuda_buffer>);

}  // namespace fsdp
