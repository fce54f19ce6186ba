#pragma once
//! \file The host device: CPU memory with per-rank live/peak accounting, and in-order work
//! queues with CUDA-stream semantics (enqueue returns at once, events mark points in a queue,
//! a queue can wait on another queue's event). The scheduling code that overlaps compute and
//! communication is written against this vocabulary, so it runs the same on CPU and GPU.
//!
//! Compute on the host device runs on the calling thread ("the compute queue is the caller"):
//! compute_record() returns a completed event and compute_wait() blocks the caller.
//!
//! The types model the concepts of device/concepts.hpp (event, queue, host_task_queue,
//! device_buffer, device), which state the contract a CUDA device provides with streams.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>

#include <thrust/system/cpp/execution_policy.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/detail/backoff.hpp"
#include "fsdp/detail/task.hpp"
#include "fsdp/device/concepts.hpp"

namespace fsdp {

namespace detail {

struct event_state {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

}  // namespace detail

//! A point in a host_queue. Copies refer to the same point. A default-constructed event is
//! complete.
class host_event {
 public:
  host_event() = default;

  //! True once the queue has run every task enqueued before the event (or failed).
  bool ready() const {
    if (!s_) return true;
    std::lock_guard lock(s_->m);
    return s_->done;
  }
  //! Blocks until the event completes; rethrows the queue's failure; throws
  //! fsdp::error(errc::timeout) after `timeout`.
  void wait(milliseconds timeout, std::string_view what = "queue event") const {
    if (!s_) return;
    std::unique_lock lock(s_->m);
    if (!detail::spin_then_wait(s_->cv, lock, std::chrono::steady_clock::now() + timeout, [&] { return s_->done; }))
      throw error(errc::timeout, "waited " + std::to_string(timeout.count()) + " ms for " +
                                     std::string(what));
    if (s_->error) std::rethrow_exception(s_->error);
  }

 private:
  friend class host_queue;
  explicit host_event(std::shared_ptr<detail::event_state> s) : s_(std::move(s)) {}
  void complete(std::exception_ptr e) const {
    {
      std::lock_guard lock(s_->m);
      s_->done = true;
      s_->error = std::move(e);
    }
    s_->cv.notify_all();
  }
  std::shared_ptr<detail::event_state> s_;
};
static_assert(event<host_event>);

//! An in-order work queue with its own thread: the host analogue of a CUDA stream. enqueue()
//! returns at once; tasks run one after another. A task that throws puts the queue in a failed
//! state: later tasks are dropped and every event recorded afterwards rethrows that failure.
class host_queue {
 public:
  explicit host_queue(std::string name = "queue") : name_(std::move(name)) {
    worker_ = std::thread([this] { run(); });
  }
  host_queue(const host_queue&) = delete;
  host_queue& operator=(const host_queue&) = delete;
  //! Runs what is queued, then joins the thread.
  ~host_queue() {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  const std::string& name() const noexcept { return name_; }

  //! Appends a task.
  void enqueue(detail::task t) { push(std::move(t), false); }
  //! Thrust policy for kernels launched on this queue (its thread runs them sequentially).
  static auto execution_policy() { return thrust::cpp::par; }
  //! Runs f(execution_policy()) in queue order.
  template <class F>
  void launch(F f) {
    enqueue([f = std::move(f)]() mutable { f(execution_policy()); });
  }
  //! Frees `b` once everything queued so far has run (stream-ordered free).
  template <class Buffer>
  void release(Buffer&& b) {
    enqueue([b = std::move(b)]() mutable { b.reset(); });
  }
  //! An event that completes when every task enqueued so far has run.
  host_event record() {
    host_event e(std::make_shared<detail::event_state>());
    push([this, e] { e.complete(failure()); }, true);
    return e;
  }
  //! Later tasks of this queue wait for `e` (bounded by `timeout`).
  void wait(host_event e, milliseconds timeout) {
    enqueue([e = std::move(e), timeout, this] { e.wait(timeout, "an event, on queue " + name_); });
  }
  //! Blocks the caller until everything enqueued so far has run; rethrows a failure.
  void synchronize(milliseconds timeout) { record().wait(timeout, "queue " + name_); }
  //! The failure that stopped the queue, if any.
  std::exception_ptr failure() const {
    std::lock_guard lock(m_);
    return failure_;
  }

 private:
  struct entry {
    detail::task fn;
    bool always;  // event completions run even after a failure: they report it
  };

  void push(detail::task t, bool always) {
    {
      std::lock_guard lock(m_);
      tasks_.push_back({std::move(t), always});
    }
    cv_.notify_all();
  }

  void run() {
    for (;;) {
      entry e;
      {
        std::unique_lock lock(m_);
        detail::spin_then_wait(cv_, lock, std::chrono::steady_clock::time_point::max(),
                               [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stop_ and drained
        e = std::move(tasks_.front());
        tasks_.pop_front();
        // Work after a failure is dropped, as on a CUDA stream after a sticky error.
        if (failure_ && !e.always) continue;
      }
      try {
        e.fn();
      } catch (...) {
        std::lock_guard lock(m_);
        if (!failure_) failure_ = std::current_exception();
      }
    }
  }

  std::string name_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::deque<entry> tasks_;
  std::exception_ptr failure_;
  bool stop_ = false;
  std::thread worker_;  // last: starts after the members it uses
};
static_assert(host_task_queue<host_queue>);

//! Bytes owned on a host_device, counted against its memory_stats. Move-only.
class host_buffer {
 public:
  host_buffer() = default;
  host_buffer(std::size_t bytes, mem_kind kind, std::shared_ptr<detail::memory_counter> counter)
      : bytes_(bytes), kind_(kind), counter_(std::move(counter)) {
    if (bytes_ == 0) return;
    // 64-byte aligned and zero-filled: padding must read as zero.
    ptr_ = ::operator new(bytes_, std::align_val_t{64});
    std::memset(ptr_, 0, bytes_);
    counter_->add(bytes_, kind_);
  }
  host_buffer(host_buffer&& o) noexcept { swap(o); }
  host_buffer& operator=(host_buffer&& o) noexcept {
    host_buffer(std::move(o)).swap(*this);
    return *this;
  }
  ~host_buffer() { reset(); }

  void reset() noexcept {
    if (ptr_) {
      ::operator delete(ptr_, std::align_val_t{64});
      counter_->remove(bytes_, kind_);
    }
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* data() const noexcept { return ptr_; }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const noexcept { return bytes_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  void swap(host_buffer& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(kind_, o.kind_);
    std::swap(counter_, o.counter_);
  }
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  mem_kind kind_ = mem_kind::transient;
  std::shared_ptr<detail::memory_counter> counter_;
};
static_assert(device_buffer<host_buffer>);

//! The CPU device of one rank. Copies share the same memory counters.
class host_device {
 public:
  using queue = host_queue;
  using event = host_event;
  using buffer = host_buffer;

  //! Zero-filled bytes, counted under `kind`.
  buffer allocate(std::size_t bytes, mem_kind kind) const { return buffer(bytes, kind, memory_); }
  memory_stats memory() const { return memory_->get(); }
  void reset_peak_memory() const { memory_->reset_peak(); }

  //! Thrust execution policy for kernels on this device (sequential host execution: the host
  //! device's compute is the calling thread or a queue's thread).
  static auto execution_policy() { return thrust::cpp::par; }

  // Copies and fills, ordered with compute (here: done on return).
  static void copy_from_host(void* dst, const void* src, std::size_t bytes) { copy(dst, src, bytes); }
  static void copy_to_host(void* dst, const void* src, std::size_t bytes) { copy(dst, src, bytes); }
  static void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  static void zero(void* dst, std::size_t bytes) {
    if (bytes) std::memset(dst, 0, bytes);
  }

  //! Compute runs on the caller: everything issued so far is already done.
  event compute_record() const { return {}; }
  //! Blocks the caller (the host's compute queue) until `e` completes.
  void compute_wait(const event& e, milliseconds timeout) const { e.wait(timeout); }

  static constexpr const char* name() noexcept { return "host"; }

  //! A profiler range around a hook (an NVTX range on CUDA); nothing on the host.
  struct range_guard {};
  static range_guard range(const char*) noexcept { return {}; }

 private:
  std::shared_ptr<detail::memory_counter> memory_ = std::make_shared<detail::memory_counter>();
};
static_assert(device<host_device>);

}  // namespace fsdp
