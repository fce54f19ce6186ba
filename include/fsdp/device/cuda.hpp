#pragma once
//! \file The CUDA device: GPU memory from the device's stream-ordered pool, counted into the
//! same memory_stats as the host device, and queues that are CUDA streams. Its types model the
//! concepts of device/concepts.hpp (cuda_queue is not a host_task_queue), so shard_group runs on
//! it unchanged:
//!
//!   queue (cuda_queue): a non-blocking stream. launch(f) calls f(policy) at once on the
//!          calling thread with a Thrust policy bound to the stream, so kernels are enqueued
//!          there; release(buffer) is cudaFreeAsync on the stream; record() records an event;
//!          wait(event) is cudaStreamWaitEvent (the host does not block); synchronize(timeout)
//!          polls the stream against a deadline.
//!   device (cuda_device): compute is the device's own compute stream. allocate() takes
//!          zero-filled memory from fsdp's memory pool on the device; compute_record() /
//!          compute_wait() order the compute stream with a queue; copies and fills run on the
//!          compute stream and return when done.
//!
//! Allocation: shard_group hands a new buffer to whichever stream needs it (a reduce-scatter
//! output goes straight to the reduce-scatter queue), so a buffer must be usable by every
//! stream when allocate() returns. The pool reuses a block only once the work before its free
//! has finished, never by making the allocation wait for other streams, so a block is usable
//! anywhere at once; allocate() then zeroes it on a private stream that the host waits for (for
//! set-up), while allocate_uninitialized() queues nothing and waits for nothing (a step's
//! buffers, written whole before they are read) and zero_async() zeroes in compute order. Frees
//! are stream-ordered: on the compute stream (reset()) or on a queue's stream (release()).
//! The pool is fsdp's own (cudaMemPoolCreate), so its settings do not change the device's
//! default pool that the framework may use. use_memory(source) takes the device's memory from
//! an outside allocator instead (device/cuda/block_cache.hpp: NCCL's registered memory), by
//! the same rules.
//!
//! Errors (STYLE.md 8): set-up and bounded waits throw fsdp::error; destructors and frees are
//! noexcept and drop a failed status (after a sticky error every CUDA call fails, and teardown
//! must still finish). Every failed call's error is cleared with cudaGetLastError.
//!
//! Waits never block unboundedly: they poll cudaEventQuery / cudaStreamQuery against a
//! deadline. An event may carry a wait_watcher (a communicator's health check, see
//! comm/nccl.hpp): waits on it, and later synchronisations of the stream that waited on it,
//! poll the watcher too and abort it at the deadline, since NCCL operations have no timeout of
//! their own.
//!
//! The device whose ordinal a cuda_device holds is made current on the constructing thread;
//! queues are created on the current device (shard_group creates its queues after its device).
//! Needs nvcc: kernels are launched through Thrust's CUDA system.
//!
//!   fsdp::cuda_device gpu{0};                 // throws errc::no_device without a usable GPU
//!   auto buf = gpu.allocate(1 << 20, fsdp::mem_kind::transient);
//!   fsdp::cuda_queue side{"side"};
//!   side.launch([&](auto policy) { thrust::fill_n(policy, buf.as<float>(), 1 << 18, 1.0f); });
//!   gpu.compute_wait(side.record(), std::chrono::seconds(10));

#if !defined(__CUDACC__)
#error "fsdp/device/cuda.hpp needs nvcc (it launches Thrust kernels on CUDA streams): compile this file as CUDA"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>
#include <thrust/system/cuda/execution_policy.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/core/backoff.hpp"
#include "fsdp/device/concepts.hpp"
#include "fsdp/device/cuda/graph.hpp"
#include "fsdp/device/cuda/marks.hpp"
#include "fsdp/device/cuda/memory.hpp"
#include "fsdp/device/cuda/waits.hpp"

// Thrust dispatches algorithms to the device system chosen by this macro: with the CPP system
// (how fsdp::fsdp configures host builds) the CUDA policies below would fail to instantiate.
#if THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CUDA
#error "fsdp/device/cuda.hpp needs THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CUDA (the fsdp::cuda target sets it for CUDA sources)"
#endif

namespace fsdp {

//! A point in a CUDA stream. Copies refer to the same point. A default-constructed event is
//! complete.
class cuda_event {
 public:
  cuda_event() = default;

  //! True once the stream passed the event. Throws on a CUDA error or a watcher's failure. An
  //! event recorded inside a CUDA graph capture is never ready: it happens in the graph's launches.
  bool ready() const {
    if (!ev_) return true;
    if (captured_) return false;
    const cudaError_t rc = cudaEventQuery(ev_.get());
    if (rc == cudaSuccess) return true;
    if (rc != cudaErrorNotReady) throw error(errc::internal, "cudaEventQuery: " + detail::cuda_error_text(rc));
    if (watcher_) watcher_->check("an event");
    return false;
  }
  //! Blocks until the event completes, polling against a deadline; throws fsdp::error(
  //! errc::timeout) naming `what` after `timeout` (aborting the event's communicator, if any).
  void wait(milliseconds timeout, std::string_view what = "queue event") const {
    if (!ev_) return;
    if (captured_)
      throw error(errc::invalid_argument, "waiting for " + std::string(what) + " inside a CUDA graph capture: captured work cannot make the host wait");
    std::vector<std::shared_ptr<detail::wait_watcher>> w;
    if (watcher_) w.push_back(watcher_);
    detail::cuda_poll([e = ev_.get()] { return cudaEventQuery(e); }, timeout, what, w);
  }

  cudaEvent_t native_handle() const noexcept { return ev_.get(); }
  //! The watcher attached by the communicator that produced the event, or null.
  const std::shared_ptr<detail::wait_watcher>& watcher() const noexcept { return watcher_; }
  //! For communicators: waits on this event also check `w` (see the file comment).
  void attach(std::shared_ptr<detail::wait_watcher> w) noexcept { watcher_ = std::move(w); }

  //! A new event, not yet recorded (cudaEventDisableTiming: cheaper to record and query).
  static cuda_event create() {
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    cuda_event out;
    out.ev_ = std::shared_ptr<CUevent_st>(e, [](cudaEvent_t x) {
      (void)cudaEventDestroy(x);
      (void)cudaGetLastError();
    });
    return out;
  }
  //! Records the event at the current end of `stream`.
  void record_on(cudaStream_t stream) {
    detail::cuda_check(cudaEventRecord(ev_.get(), stream), "cudaEventRecord");
    captured_ = detail::capturing(stream);
  }

 private:
  std::shared_ptr<CUevent_st> ev_;
  bool captured_ = false;  // recorded inside a capture (ready() must not query it: that ends the capture)
  std::shared_ptr<detail::wait_watcher> watcher_;
};
static_assert(event<cuda_event>);

//! An in-order work queue: a non-blocking CUDA stream on the device current at construction.
class cuda_queue {
 public:
  explicit cuda_queue(std::string name = "queue", queue_priority priority = queue_priority::normal) : name_(std::move(name)) {
    cudaError_t rc = cudaGetDevice(&ordinal_);
    int least = 0, greatest = 0;  // numerically: greatest < least (lower is more urgent)
    if (rc == cudaSuccess) rc = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (rc == cudaSuccess)
      rc = cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority == queue_priority::high ? greatest : least);
    if (rc != cudaSuccess)
      throw error(errc::no_device, "no CUDA device: cannot create stream '" + name_ + "': " + detail::cuda_error_text(rc));
  }
  cuda_queue(const cuda_queue&) = delete;
  cuda_queue& operator=(const cuda_queue&) = delete;
  //! Lets queued work finish (bounded by default_timeout()), then destroys the stream: buffers
  //! freed after the queue on another stream must not be in use here any more.
  ~cuda_queue() {
    try {
      detail::cuda_poll([s = stream_] { return cudaStreamQuery(s); }, default_timeout(), "queue " + name_ + " teardown",
                        watched_.get());
    } catch (...) {
    }
    (void)cudaStreamDestroy(stream_);
    (void)cudaGetLastError();
  }

  const std::string& name() const noexcept { return name_; }
  cudaStream_t native_handle() const noexcept { return stream_; }
  //! Capability (device/concepts.hpp): a point on the GPU's clock, at the current end of the stream.
  device_mark mark() const { return detail::cuda_mark(stream_, ordinal_); }
  int device_ordinal() const noexcept { return ordinal_; }

  //! Thrust policy for kernels on this stream (no synchronisation after each algorithm).
  auto execution_policy() const { return thrust::cuda::par_nosync.on(stream_); }
  //! Calls f(execution_policy()) now, on the calling thread: the kernels it launches run in
  //! stream order.
  template <class F>
  void launch(F f) {
    detail::nvtx_range range(name_.c_str());
    detail::cuda_use(ordinal_);
    f(execution_policy());
  }
  //! Frees `b` once everything queued so far on this stream has run (stream-ordered free).
  void release(cuda_buffer&& b) noexcept { b.release_on(stream_); }
  //! An event at the current end of the stream.
  cuda_event record() {
    cuda_event e = cuda_event::create();
    e.record_on(stream_);
    return e;
  }
  //! Later work of this stream waits for `e` on the GPU; the host does not block. (The bound
  //! applies where the host waits: synchronize() and event waits check e's watcher.)
  void wait(const cuda_event& e, milliseconds /*timeout*/) {
    if (!e.native_handle()) return;
    if (e.watcher()) e.watcher()->check("an event waited on by queue " + name_);
    detail::cuda_check(cudaStreamWaitEvent(stream_, e.native_handle(), 0), "cudaStreamWaitEvent on queue " + name_);
    watched_.add(e.watcher());
  }
  //! For communicators: synchronize() (and the teardown wait) also check `w`, whose
  //! collectives were enqueued here.
  void watch(const std::shared_ptr<detail::wait_watcher>& w) { watched_.add(w); }
  //! Blocks the caller until everything queued so far has run; throws errc::timeout after
  //! `timeout`.
  void synchronize(milliseconds timeout) {
    detail::cuda_poll([s = stream_] { return cudaStreamQuery(s); }, timeout, "queue " + name_, watched_.get());
  }

 private:
  std::string name_;
  int ordinal_ = 0;
  cudaStream_t stream_ = nullptr;
  detail::watch_list watched_;
};
static_assert(queue<cuda_queue> && !host_task_queue<cuda_queue>);

//! One GPU of a rank. Copies share the compute stream, pool and memory counters.
class cuda_device {
 public:
  using queue = cuda_queue;
  using event = cuda_event;
  using buffer = cuda_buffer;

  //! The calling thread's current device (device 0 unless cudaSetDevice chose another).
  cuda_device() : cuda_device(-1) {}
  //! Device `ordinal`, made current on the calling thread. Throws fsdp::error(errc::no_device,
  //! "no CUDA device: ...") when there is no usable GPU (no driver, none present, no such
  //! ordinal).
  explicit cuda_device(int ordinal) : s_(std::make_shared<detail::cuda_device_state>()) {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();  // the failure must not show up in the caller's next CUDA call
      throw error(errc::no_device, std::string("no CUDA device: ") + cudaGetErrorString(rc));
    }
    if (count == 0) throw error(errc::no_device, "no CUDA device: the driver reports 0 devices");
    if (ordinal < 0 && cudaGetDevice(&ordinal) != cudaSuccess) {
      (void)cudaGetLastError();
      ordinal = 0;
    }
    if (ordinal >= count)
      throw error(errc::no_device, "no CUDA device: device " + std::to_string(ordinal) + " requested, " +
                                       std::to_string(count) + " present");
    s_->ordinal = ordinal;
    detail::cuda_check(cudaSetDevice(ordinal), "cudaSetDevice(" + std::to_string(ordinal) + ")", errc::no_device);
    detail::cuda_check(cudaStreamCreateWithFlags(&s_->compute, cudaStreamNonBlocking), "creating the compute stream",
                       errc::no_device);
    detail::cuda_check(cudaStreamCreateWithFlags(&s_->alloc, cudaStreamNonBlocking), "creating the allocation stream");
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = ordinal;
    detail::cuda_check(cudaMemPoolCreate(&s_->pool, &props), "cudaMemPoolCreate");
    // Keep freed memory in the pool (as PyTorch's caching allocator does): gathered buckets are
    // freed and reallocated every step, and returning them to the driver would synchronise.
    std::uint64_t keep = UINT64_MAX;
    detail::cuda_check(cudaMemPoolSetAttribute(s_->pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
    // Never make an allocation wait for another stream's work (the host waits for the
    // allocation stream): reuse only blocks whose free has completed.
    int no = 0;
    detail::cuda_check(cudaMemPoolSetAttribute(s_->pool, cudaMemPoolReuseAllowInternalDependencies, &no),
                       "cudaMemPoolSetAttribute");
    s_->thrust_alloc = {s_->pool, s_->compute};
  }

  int ordinal() const noexcept { return s_->ordinal; }
  //! The stream compute runs on: launch the model's kernels here.
  cudaStream_t compute_stream() const noexcept { return s_->compute; }
  //! Makes this device current on the calling thread (needed once per thread that launches).
  void make_current() const { detail::cuda_use(s_->ordinal); }

  //! Zero-filled bytes, counted under `kind`, usable by every stream on return (the host waits
  //! for the zeroing: for set-up, not for a step).
  buffer allocate(std::size_t bytes, mem_kind kind) const { return buffer(bytes, kind, s_); }
  //! Capability (device/concepts.hpp): bytes of unspecified content, usable by every stream on
  //! return with no host wait, since nothing is queued for them (the pool hands out only blocks
  //! whose free has completed). For buffers written whole before they are read: gathered
  //! buckets, reduction outputs.
  buffer allocate_uninitialized(std::size_t bytes, mem_kind kind) const { return buffer(bytes, kind, s_, false); }
  //! Capability (device/concepts.hpp): the same, for a buffer whose first user is `first_use`
  //! (a collective's output). Only a CUDA graph capture needs to know: the allocation is then a
  //! node on that stream (device/cuda/memory.hpp).
  buffer allocate_uninitialized(std::size_t bytes, mem_kind kind, const queue& first_use) const {
    return buffer(bytes, kind, s_, false, first_use.native_handle());
  }
  //! Capability (device/concepts.hpp): zeroes `bytes` at `dst` in compute order, without
  //! waiting. Device memory only (offloaded state is pinned host memory: zero() it).
  void zero_async(void* dst, std::size_t bytes) const {
    if (!bytes) return;
    make_current();
    detail::cuda_check(cudaMemsetAsync(dst, 0, bytes, s_->compute), "cudaMemsetAsync");
  }
  //! From now on, device memory comes from `source` instead of fsdp's pool: its blocks, cached
  //! and reused in stream order by size (device/block_cache.hpp), so a step calls it only for a
  //! size not seen before or while every block of that size is still in use. Pinned host memory
  //! (offload) and buffers allocated inside a CUDA graph capture (the graph's own) still come
  //! from CUDA. Set once a device, before the allocations it should serve (a shard_group's, to
  //! give NCCL registered buffers: made after the model, whose buffers need not be registered),
  //! while no other thread allocates there; a second source is refused.
  void use_memory(cuda_memory_source source) const {
    if (s_->source)
      throw error(errc::invalid_argument, "cuda_device::use_memory: device " + std::to_string(s_->ordinal) + " takes its memory from '" +
                                              s_->source->name() + "' already");
    s_->source = std::make_unique<detail::cuda_block_cache>(std::move(source));
  }
  //! What use_memory's source has given so far (blocks, bytes asked), held until the device goes:
  //! memory() counts only the bytes of live buffers. Zero without a source.
  memory_held memory_source_held() const { return s_->source ? s_->source->holding() : memory_held{}; }
  memory_stats memory() const { return s_->memory.get(); }
  void reset_peak_memory() const { s_->memory.reset_peak(); }

  //! Capability (device/concepts.hpp): true while the compute stream is being captured into a
  //! CUDA graph (cuda_graph::capture(device, ...)); what must run on the host refuses then.
  bool capturing() const { return detail::capturing(s_->compute); }
  //! Buffers allocated inside captures and not yet freed inside one (cuda_graph::capture checks
  //! that a captured step frees what it allocates).
  long graph_allocations() const noexcept { return s_->graph_owned.load(std::memory_order_relaxed); }

  //! Thrust policy for kernels on the compute stream; temporary storage from the pool.
  auto execution_policy() const { return thrust::cuda::par_nosync(s_->thrust_alloc).on(s_->compute); }

  // Copies and fills, on the compute stream; they return when done (bounded by
  // default_timeout()). Host pointers may be pageable.
  void copy_from_host(void* dst, const void* src, std::size_t bytes) const { copy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) const { copy(dst, src, bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (!bytes) return;
    make_current();
    detail::cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_->compute), "cudaMemcpyAsync");
    synchronize(default_timeout());
  }
  void zero(void* dst, std::size_t bytes) const {
    if (!bytes) return;
    make_current();
    detail::cuda_check(cudaMemsetAsync(dst, 0, bytes, s_->compute), "cudaMemsetAsync");
    synchronize(default_timeout());
  }

  //! Capability (device/concepts.hpp): a point on the GPU's clock, at the current end of compute.
  device_mark compute_mark() const { return detail::cuda_mark(s_->compute, s_->ordinal); }
  //! An event at the current end of the compute stream.
  event compute_record() const {
    event e = event::create();
    e.record_on(s_->compute);
    return e;
  }
  //! Orders later compute after `e` (on the GPU: the host does not block; the bound applies
  //! where the host next waits on the compute stream).
  void compute_wait(const event& e, milliseconds /*timeout*/) const {
    if (!e.native_handle()) return;
    if (e.watcher()) e.watcher()->check("an event waited on by the compute stream");
    detail::cuda_check(cudaStreamWaitEvent(s_->compute, e.native_handle(), 0), "cudaStreamWaitEvent on the compute stream");
    s_->watched.add(e.watcher());
  }
  //! Blocks until the compute stream is idle; throws errc::timeout after `timeout`.
  void synchronize(milliseconds timeout) const {
    detail::cuda_poll([s = s_->compute] { return cudaStreamQuery(s); }, timeout, "the compute stream", s_->watched.get());
  }

  static constexpr const char* name() noexcept { return "cuda"; }

  //! An NVTX range (Nsight Systems shows each hook); shard_group opens one per hook.
  static detail::nvtx_range range(const char* name) noexcept { return detail::nvtx_range(name); }

 private:
  std::shared_ptr<detail::cuda_device_state> s_;
};
static_assert(device<cuda_device>);

}  // namespace fsdp
