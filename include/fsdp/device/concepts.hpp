#pragma once
//! \file The device vocabulary: what shard_group, the optimizers and the communicators need of a
//! device, its work queues, their events and its buffers. Devices are sibling headers
//! (device/host.hpp: the CPU; device/cuda.hpp: a GPU, needs nvcc), and each checks its types
//! against these concepts.
//!
//! Queues have CUDA-stream semantics: work runs in queue order, and the call that issues it
//! does not wait for it (launch() may run a callable at once when the callable itself only
//! enqueues, as Thrust does on a stream); an event marks a point in a queue; a queue, or the
//! device's compute, can wait for another queue's event. The compute queue is the device's own
//! (the host device computes on the calling thread, the CUDA device on its compute stream).
//! Every wait of the host is bounded by a timeout (core/timeout.hpp) and throws
//! fsdp::error(errc::timeout) when it passes.

#include <concepts>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "fsdp/core/error.hpp"
#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"

namespace fsdp {

namespace detail {
//! Stand-ins for the callables callers pass, to check the members that take any callable.
struct policy_callable_archetype {  // launch(f): f(policy)
  template <class Policy>
  void operator()(const Policy&) const {}
};
struct host_task_archetype {  // enqueue(f): f()
  void operator()() const {}
};
//! The event type a queue's record() returns.
template <class Q>
using recorded_event_t = std::remove_cvref_t<decltype(std::declval<Q&>().record())>;
}  // namespace detail

//! Event, a point in a queue: (1) default-constructible, and a default-constructed event is
//! complete; (2) copyable, copies referring to the same point; (3) ready() -> bool: whether the
//! queue has passed the point, without blocking; (4) wait(timeout, what) and wait(timeout):
//! block until the point is passed, throwing fsdp::error naming `what` (a std::string_view)
//! after `timeout` or when the queue failed.
template <class E>
concept event = std::default_initializable<E> && std::copyable<E> &&
    requires(const E& e, milliseconds timeout, std::string_view what) {
      { e.ready() } -> std::convertible_to<bool>;
      e.wait(timeout, what);
      e.wait(timeout);
    };

//! Buffer, bytes owned on a device and counted in its memory_stats: (1) default-constructible
//! (empty) and movable; (2) data() -> void*; (3) bytes() -> the size; (4) as<T>() -> T*, the
//! same address typed; (5) reset() frees now (in compute order) and empties it; (6) tests as
//! bool: whether it holds memory. A queue frees one in its own order with release() (checked by
//! `device`, which knows both types).
template <class B>
concept device_buffer = std::default_initializable<B> && std::movable<B> &&
    requires(B& b, const B& cb) {
      { cb.data() } -> std::same_as<void*>;
      { cb.bytes() } -> std::convertible_to<std::size_t>;
      { cb.template as<float>() } -> std::same_as<float*>;
      b.reset();
      static_cast<bool>(cb);
    };

//! Queue, an in-order work queue: (1) constructible from a name (a std::string); (2) launch(f)
//! calls f(policy) in queue order, with a Thrust execution policy that runs f's algorithms
//! there; (3) record() -> an event at the current end of the queue; (4) wait(event, timeout):
//! later work of the queue waits for the event (the bound applies where the host blocks);
//! (5) synchronize(timeout) blocks the caller until everything queued so far has run.
//! release(buffer&&), a free in queue order, is checked by `device`, which knows the buffer.
template <class Q>
concept queue = std::constructible_from<Q, std::string> &&
    requires(Q& q) {
      { q.record() } -> event;
    } &&
    requires(Q& q, const detail::recorded_event_t<Q>& e, milliseconds timeout,
             detail::policy_callable_archetype f) {
      q.launch(std::move(f));
      q.wait(e, timeout);
      q.synchronize(timeout);
    };

//! Capability: a queue that can also (6) enqueue(f) a host task, f(), run in queue order (the
//! host_queue; a CUDA stream cannot). shard_group uses it to timestamp collectives.
template <class Q>
concept host_task_queue = queue<Q> && requires(Q& q, detail::host_task_archetype f) { q.enqueue(std::move(f)); };

//! A point on a device's own clock (a timed CUDA event), for the spans a device times itself
//! (hook_profiler's time_on_device): the queue and compute of a device that has the capability
//! give one with mark() and compute_mark(). ms_between(earlier, later) is the time between two
//! marks in milliseconds, or negative while either has not happened yet.
struct device_mark {
  std::shared_ptr<void> handle;
  double (*ms_between)(const void* earlier, const void* later) = nullptr;
  explicit operator bool() const noexcept { return handle != nullptr; }
  double ms_since(const device_mark& earlier) const { return ms_between(earlier.handle.get(), handle.get()); }
};

//! A queue's scheduling priority, for queues that have one (CUDA streams: constructible from a
//! name and a priority). shard_group runs its collectives' queues at high priority.
enum class queue_priority { normal, high };

//! Optional capabilities of a device, used where present (the helpers below fall back to what
//! every device has): a queue constructible from a name and a priority; compute_mark(), a
//! device_mark at the end of compute (CUDA events on the GPU's clock); allocate_uninitialized(bytes,
//! kind) -> buffer of unspecified content, usable by every queue with no host wait;
//! zero_async(dst, bytes), a zero fill in compute order that does not wait. The CUDA device has
//! both, so a step allocates and zeroes without the host waiting for the GPU (the host device's
//! zero-filled vectors need neither); and allocate_uninitialized(bytes, kind, queue), naming the
//! buffer's first user, and capturing(), true while compute is captured into a CUDA graph.
namespace detail {
template <class D>
auto allocate_uninitialized(D& d, std::size_t bytes, mem_kind kind) {
  if constexpr (requires { d.allocate_uninitialized(bytes, kind); }) return d.allocate_uninitialized(bytes, kind);
  else return d.allocate(bytes, kind);
}
//! The same, for a buffer first used on queue `first_use` (a collective's output): where the
//! device captures graphs, the allocation is then made on that queue's stream.
template <class D, class Q>
auto allocate_uninitialized(D& d, std::size_t bytes, mem_kind kind, const Q& first_use) {
  if constexpr (requires { d.allocate_uninitialized(bytes, kind, first_use); }) return d.allocate_uninitialized(bytes, kind, first_use);
  else return allocate_uninitialized(d, bytes, kind);
}
//! Work that must run on the host refuses inside a CUDA graph capture, by name, with the
//! reason (`why`), instead of failing on a CUDA error or being frozen into every launch.
template <class D>
void refuse_in_capture(const D& d, const std::string& what, const char* why, int rank) {
  if constexpr (requires { d.capturing(); })
    if (d.capturing()) throw error(errc::invalid_argument, what + " inside a CUDA graph capture: " + why, {rank});
}
template <class D>
void zero_async(D& d, void* dst, std::size_t bytes) {
  if constexpr (requires { d.zero_async(dst, bytes); }) d.zero_async(dst, bytes);
  else d.zero(dst, bytes);
}
//! A queue named `name`, at high priority when asked and the queue type has priorities.
template <class Q>
Q make_queue(const char* name, bool high) {
  if constexpr (std::constructible_from<Q, std::string, queue_priority>) return Q(name, high ? queue_priority::high : queue_priority::normal);
  else return Q(name);
}
//! A point on the device's own clock at the current end of compute (none on a device without one).
template <class D>
device_mark compute_mark(D& d) {
  if constexpr (requires { d.compute_mark(); }) return d.compute_mark();
  else return {};
}
//! A zero-filled buffer for compute to write: zeroed in compute order where the device can.
template <class D>
auto allocate_for_compute(D& d, std::size_t bytes, mem_kind kind) {
  if constexpr (requires(void* p) { d.allocate_uninitialized(bytes, kind); d.zero_async(p, bytes); }) {
    auto b = d.allocate_uninitialized(bytes, kind);
    d.zero_async(b.data(), bytes);
    return b;
  } else {
    return d.allocate(bytes, kind);
  }
}
}  // namespace detail

//! Device, the memory and compute of one rank; copies share its state: (1) copy-constructible;
//! (2) types queue, event and buffer that model the concepts above, where the queue's record()
//! returns the device's event; (3) allocate(bytes, mem_kind) -> buffer, zero-filled and usable
//! by every queue; memory() -> memory_stats; reset_peak_memory(); (4) execution_policy(), the
//! Thrust policy for kernels in compute order; (5) copy_from_host(dst, src, bytes),
//! copy_to_host, copy and zero(dst, bytes), ordered with compute and done on return;
//! (6) compute_record() -> event at the current end of compute; compute_wait(event, timeout):
//! later compute waits for the event; (7) range(const char*) -> an RAII profiler range;
//! (8) name() -> a string; (9) queue.release(buffer&&) frees the buffer once the work queued so
//! far has run.
template <class D>
concept device = std::copy_constructible<D> &&
    requires {
      typename D::queue;
      typename D::event;
      typename D::buffer;
    } &&
    queue<typename D::queue> && event<typename D::event> && device_buffer<typename D::buffer> &&
    std::same_as<detail::recorded_event_t<typename D::queue>, typename D::event> &&
    requires(D& d, typename D::queue& q, typename D::buffer& b, const typename D::event& e, std::size_t bytes,
             mem_kind kind, void* dst, const void* src, milliseconds timeout, const char* name) {
      { d.allocate(bytes, kind) } -> std::same_as<typename D::buffer>;
      { d.memory() } -> std::convertible_to<memory_stats>;
      d.reset_peak_memory();
      d.execution_policy();
      d.copy_from_host(dst, src, bytes);
      d.copy_to_host(dst, src, bytes);
      d.copy(dst, src, bytes);
      d.zero(dst, bytes);
      { d.compute_record() } -> std::same_as<typename D::event>;
      d.compute_wait(e, timeout);
      { d.range(name) } -> std::destructible;
      { d.name() } -> std::convertible_to<std::string_view>;
      q.release(std::move(b));
    };

}  // namespace fsdp
