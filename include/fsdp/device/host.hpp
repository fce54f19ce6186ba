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
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <thrust/system/cpp/execution_policy.h>

#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/core/backoff.hpp"
#include "fsdp/core/task.hpp"
#include "fsdp/device/concepts.hpp"

namespace fsdp {

//! Which tasks of a host_queue a thread that waits for one of its events may run itself
//! (host_queue::enqueue, host_event::wait).
enum class run_on : std::uint8_t {
  queue_thread,     //!< only the queue's own thread (the default)
  queue_or_waiter,  //!< on a queue_wake::on_wait queue, also a thread that waits for a later event
};

//! When a host_queue's thread learns of new work (host_queue's constructor).
//!
//! Why two. Waking a sleeping thread is a futex call, and the woken thread then takes a core
//! from whatever ran there: on this 2-core VM the two hand-offs of a collective issued and waited
//! for at once (to the queue's thread and back) cost more than moving 64 KiB (docs/benchmarks.md,
//! "Collectives issued and waited for at once"). A queue whose work runs while the caller
//! computes needs its thread woken at once; a queue whose every event is waited for right after
//! it is recorded does not, as the waiting thread can run the work itself.
enum class queue_wake : std::uint8_t {
  //! Every enqueue wakes the queue's thread, which runs every task (the default: CUDA streams'
  //! semantics, work runs while the caller goes on).
  on_enqueue,
  //! A task enqueued with run_on::queue_or_waiter does not wake the queue's thread: a thread that
  //! waits for a later event of the queue runs it (host_event::wait), or the queue's thread once
  //! a later task wakes it, or the destructor. For a queue whose events are each waited for
  //! before the caller waits for anything else: a peer's collective that nobody waits for does
  //! not start, and peers that wait for it time out.
  on_wait,
};

namespace detail {

//! A host_queue's tasks and who runs them, and how many have run: shared with the queue's
//! events, which are positions in that count (so recording one queues nothing), and with which
//! a thread waiting for an event of a queue_wake::on_wait queue runs the tasks before it.
struct queue_state {
  struct entry {
    task fn;
    run_on where = run_on::queue_thread;
  };
  static constexpr std::uint64_t no_failure = ~std::uint64_t{0};

  explicit queue_state(queue_wake w) : wake(w) {}

  //! Runs the front task if no task is running and, for a waiter, the task may run on one; a
  //! task queued after a failure is dropped instead. Returns whether it took a task. `lock`
  //! holds `m` on entry and on return.
  bool run_front(std::unique_lock<std::mutex>& lock, bool by_waiter) {
    if (by_waiter ? !front_for_waiter() : (busy || tasks.empty())) return false;
    entry e = std::move(tasks.front());
    tasks.pop_front();
    queued = tasks.size();
    if (e.where == run_on::queue_thread) --thread_tasks;
    std::exception_ptr thrown;
    // Work after a failure is dropped, as on a CUDA stream after a sticky error.
    if (!failure) {
      busy = true;
      lock.unlock();
      try {
        e.fn();
      } catch (...) {
        thrown = std::current_exception();
      }
      e.fn = {};  // the task's captures die outside the lock
      lock.lock();
      busy = false;
    }
    const std::uint64_t index = finished.load(std::memory_order_relaxed);
    if (thrown && !failure) {
      failure = std::move(thrown);
      failed_at.store(index, std::memory_order_release);
    }
    finished.store(index + 1, std::memory_order_release);
    // Waiters wait for `finished` (or, on an on_wait queue, for a task they may run), and so
    // does the queue's thread when a waiter ran this task (for a task only it may run, or the
    // destructor's drain). The queue's thread is not woken otherwise: that wake-up is the cost
    // an on_wait queue saves.
    waiter_cv.notify_all();
    if (by_waiter && (stop || (!tasks.empty() && tasks.front().where == run_on::queue_thread))) cv.notify_all();
    return true;
  }

  //! Whether a waiter may run the front task now.
  bool front_for_waiter() const noexcept {
    return !busy && !tasks.empty() && wake == queue_wake::on_wait && tasks.front().where == run_on::queue_or_waiter;
  }

  //! Whether the queue's thread has a task to run now: on an on_wait queue, only once a task
  //! that needs it is queued (it then runs the tasks before that one too).
  bool work_for_thread() const noexcept {
    return !busy && !tasks.empty() && (wake == queue_wake::on_enqueue || thread_tasks > 0);
  }

  //! The failure of a task before position `ticket`, if any (without `m`: `failure` is written
  //! once, before failed_at publishes it).
  std::exception_ptr failure_before(std::uint64_t ticket) const {
    return failed_at.load(std::memory_order_acquire) < ticket ? failure : nullptr;
  }

  const queue_wake wake;
  std::mutex m;                // guards what follows, and is the lock of both condition variables
  std::condition_variable cv;         // the queue's thread waits here for work
  std::condition_variable waiter_cv;  // event waiters wait here for `finished` (on_wait: or a task)
  std::deque<entry> tasks;
  std::exception_ptr failure;
  bool busy = false;  // a task is running, on the queue's thread or a waiter
  // tasks.size() and the destructor's request, also readable without `m`: the queue's idle
  // thread polls them lock-free while it spins (detail::spin_then_wait's peek).
  std::atomic<std::size_t> queued{0};
  std::atomic<bool> stop{false};
  std::size_t thread_tasks = 0;  // queued tasks of run_on::queue_thread
  // Tasks ever enqueued and ever finished (run or dropped), written under `m`, read without it
  // by record() and ready(); the index of the task that failed first.
  std::atomic<std::uint64_t> enqueued{0}, finished{0}, failed_at{no_failure};
};

}  // namespace detail

//! A point in a host_queue: the count of its tasks enqueued before it, complete once that many
//! have run. Copies refer to the same point. A default-constructed event is complete.
class host_event {
 public:
  host_event() = default;

  //! True once the queue has run every task enqueued before the event (or failed).
  bool ready() const { return !q_ || q_->finished.load(std::memory_order_acquire) >= ticket_; }

  //! Blocks until the event completes; rethrows the failure of a task before it; throws
  //! fsdp::error(errc::timeout) after `timeout`.
  //!
  //! On a queue_wake::on_wait queue, while the front task was enqueued with
  //! run_on::queue_or_waiter and no task is running, the waiting thread runs it itself, up to
  //! the event: such a task is bounded by its own timeout, not by this wait's, so the wait then
  //! lasts at least as long as the task.
  void wait(milliseconds timeout, std::string_view what = "queue event") const {
    if (!ready()) {
      // The clock is read only once the wait has to wait: an issued-and-waited collective on
      // an on_wait queue is done by the time the first check below fails.
      std::optional<std::chrono::steady_clock::time_point> deadline;
      auto at = [&] { return deadline ? *deadline : *(deadline = std::chrono::steady_clock::now() + timeout); };
      auto is_ready = [&] { return ready(); };  // an atomic: also the lock-free peek
      std::unique_lock lock(q_->m);
      if (q_->wake == queue_wake::on_wait) {
        // Run what may run here; wait for the next such task or the event.
        for (;;) {
          while (!ready() && q_->run_front(lock, true)) {
          }
          if (ready() || !detail::spin_then_wait(q_->waiter_cv, lock, at(), [&] { return ready() || q_->front_for_waiter(); }))
            break;
        }
      } else {
        detail::spin_then_wait(q_->waiter_cv, lock, at(), is_ready, is_ready);
      }
      if (!ready())
        throw error(errc::timeout, "waited " + std::to_string(timeout.count()) + " ms for " + std::string(what));
    }
    if (q_)
      if (auto e = q_->failure_before(ticket_)) std::rethrow_exception(e);
  }

 private:
  friend class host_queue;
  host_event(std::shared_ptr<detail::queue_state> q, std::uint64_t ticket) : q_(std::move(q)), ticket_(ticket) {}
  std::shared_ptr<detail::queue_state> q_;
  std::uint64_t ticket_ = 0;
};
static_assert(event<host_event>);

//! An in-order work queue with its own thread: the host analogue of a CUDA stream. enqueue()
//! returns at once; tasks run one after another, one at a time. A task that throws puts the
//! queue in a failed state: later tasks are dropped and every event recorded afterwards rethrows
//! that failure. Tasks run on the queue's thread, except on a queue_wake::on_wait queue, where a
//! thread waiting for an event runs the run_on::queue_or_waiter tasks before it.
class host_queue {
 public:
  explicit host_queue(std::string name = "queue", queue_wake wake = queue_wake::on_enqueue)
      : name_(std::move(name)), s_(std::make_shared<detail::queue_state>(wake)) {
    worker_ = std::thread([s = s_] { run(*s); });
  }
  host_queue(const host_queue&) = delete;
  host_queue& operator=(const host_queue&) = delete;
  //! Runs what is queued, then joins the thread.
  ~host_queue() {
    {
      std::lock_guard lock(s_->m);
      s_->stop = true;
    }
    s_->cv.notify_all();
    worker_.join();
  }

  const std::string& name() const noexcept { return name_; }
  queue_wake wake() const noexcept { return s_->wake; }

  //! Appends a task. run_on::queue_or_waiter: on a queue_wake::on_wait queue, a thread that
  //! waits for a later event may run it (host_event::wait); only for a task that depends on
  //! nothing the waiting thread would do after its wait and is bounded by a timeout of its own.
  void enqueue(detail::task t, run_on where = run_on::queue_thread) { push(std::move(t), where); }
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
    // The free rides on the last queued task when that has not started: it dies with the task,
    // right after it ran (or was skipped after a failure), which is queue order, and costs the
    // queue's thread no hand-off of its own (shard_group frees a buffer after most collectives).
    {
      std::lock_guard lock(s_->m);
      if (!s_->tasks.empty()) {
        detail::task& last = s_->tasks.back().fn;
        last = [run = std::move(last), b = std::move(b)]() mutable { run(); };
        return;
      }
    }
    enqueue([b = std::move(b)]() mutable { b.reset(); });
  }
  //! An event that completes when every task enqueued so far has run. Queues nothing: the
  //! event is the count of tasks enqueued so far (it was a completion task with a mutex and a
  //! condition variable of its own; docs/benchmarks.md, "Events as positions in the queue").
  host_event record() { return host_event(s_, s_->enqueued.load(std::memory_order_acquire)); }
  //! Later tasks of this queue wait for `e` (bounded by `timeout`).
  void wait(host_event e, milliseconds timeout) {
    enqueue([e = std::move(e), timeout, this] { e.wait(timeout, "an event, on queue " + name_); });
  }
  //! Blocks the caller until everything enqueued so far has run; rethrows a failure.
  void synchronize(milliseconds timeout) { record().wait(timeout, "queue " + name_); }
  //! The failure that stopped the queue, if any.
  std::exception_ptr failure() const { return failure_of(*s_); }

 private:
  static std::exception_ptr failure_of(detail::queue_state& s) {
    std::lock_guard lock(s.m);
    return s.failure;
  }

  void push(detail::task t, run_on where) {
    {
      std::lock_guard lock(s_->m);
      s_->tasks.push_back({std::move(t), where});
      s_->queued = s_->tasks.size();
      s_->enqueued.store(s_->enqueued.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      if (where == run_on::queue_thread) ++s_->thread_tasks;
    }
    if (s_->wake == queue_wake::on_enqueue || where == run_on::queue_thread) s_->cv.notify_all();
  }

  // The queue's thread: runs tasks until stopped and drained, never while a waiter runs one.
  static void run(detail::queue_state& s) {
    std::unique_lock lock(s.m);
    for (;;) {
      detail::spin_then_wait(s.cv, lock, std::chrono::steady_clock::time_point::max(),
                             [&] { return s.work_for_thread() || (s.stop && !s.busy); },
                             [&] { return s.queued.load() > 0 || s.stop.load(); });
      if (s.tasks.empty()) return;  // stopped and drained
      s.run_front(lock, false);
    }
  }

  std::string name_;
  std::shared_ptr<detail::queue_state> s_;
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
    // 64-byte aligned and zero-filled (padding must read as zero), aligned by hand inside a
    // calloc'd block 63 bytes longer. Not the aligned operator new: glibc serves it through
    // memalign, which carves the block out of a larger chunk and frees the pieces, about 800
    // instructions a call under callgrind here, and shard_group allocates a buffer for every
    // all-gather. With this (and the profiler's span names built only when recorded), a 2-rank
    // f32 step ran 8% fewer instructions on the rank threads (callgrind; docs/benchmarks.md,
    // "Toolkit overhead").
    if (bytes_ > SIZE_MAX - alignment) throw std::bad_alloc();  // the block's size would wrap
    block_ = std::calloc(bytes_ + alignment - 1, 1);
    if (!block_) throw std::bad_alloc();
    const auto at = reinterpret_cast<std::uintptr_t>(block_);
    ptr_ = static_cast<char*>(block_) + ((alignment - at % alignment) % alignment);
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
      std::free(block_);
      counter_->remove(bytes_, kind_);
    }
    block_ = ptr_ = nullptr;
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
  static constexpr std::size_t alignment = 64;
  void swap(host_buffer& o) noexcept {
    std::swap(block_, o.block_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(kind_, o.kind_);
    std::swap(counter_, o.counter_);
  }
  void* block_ = nullptr;  // what calloc returned; ptr_ is inside it
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
