// Tests of the device concepts (device/concepts.hpp): the host device's types model them, and a
// fake device that models them stops doing so when any one member is missing.
//
// The fakes are class templates whose members carry a requires-clause: fake_*<omit::x> lacks
// member x (it is not viable, as if not declared), and everything else is as a model needs.

#include "fsdp/device/concepts.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <string_view>

#include "fsdp/core/memory.hpp"
#include "fsdp/core/timeout.hpp"
#include "fsdp/device/host.hpp"

namespace {

// The host device (the CUDA device is checked in device/cuda.hpp and tests/cuda).
static_assert(fsdp::event<fsdp::host_event>);
static_assert(fsdp::queue<fsdp::host_queue>);
static_assert(fsdp::host_task_queue<fsdp::host_queue>);
static_assert(fsdp::device_buffer<fsdp::host_buffer>);
static_assert(fsdp::device<fsdp::host_device>);
// Not the other way round.
static_assert(!fsdp::device<fsdp::host_queue>);
static_assert(!fsdp::queue<fsdp::host_event>);
static_assert(!fsdp::event<fsdp::host_buffer>);  // no ready(), and not copyable

// The member a fake leaves out.
enum class omit {
  nothing,
  // event
  ready,
  wait,
  // buffer
  data,
  bytes,
  as,
  reset,
  // queue
  launch,
  record,
  queue_wait,
  synchronize,
  release,
  enqueue,
  // device
  allocate,
  memory,
  reset_peak_memory,
  execution_policy,
  copy_from_host,
  copy_to_host,
  copy,
  zero,
  compute_record,
  compute_wait,
  range,
  name,
};

// The omission of a fake device that concerns its event, its buffer (else: none).
constexpr omit event_part(omit o) { return o == omit::ready || o == omit::wait ? o : omit::nothing; }
constexpr omit buffer_part(omit o) {
  return o == omit::data || o == omit::bytes || o == omit::as || o == omit::reset ? o : omit::nothing;
}

template <omit O = omit::nothing>
struct fake_event {
  bool ready() const
    requires(O != omit::ready)
  {
    return true;
  }
  void wait(fsdp::milliseconds, std::string_view = "event") const
    requires(O != omit::wait)
  {}
};

template <omit O = omit::nothing>
struct fake_buffer {
  fake_buffer() = default;
  fake_buffer(fake_buffer&&) = default;
  fake_buffer& operator=(fake_buffer&&) = default;
  void* data() const
    requires(O != omit::data)
  {
    return nullptr;
  }
  std::size_t bytes() const
    requires(O != omit::bytes)
  {
    return 0;
  }
  template <class T>
    requires(O != omit::as)
  T* as() const {
    return nullptr;
  }
  void reset()
    requires(O != omit::reset)
  {}
  explicit operator bool() const { return false; }
};

// Without enqueue() unless asked for: the CUDA-stream-like base case.
template <omit O = omit::nothing, bool HostTasks = false>
struct fake_queue {
  explicit fake_queue(std::string) {}
  template <class F>
    requires(O != omit::launch)
  void launch(F) {}
  fake_event<event_part(O)> record()
    requires(O != omit::record)
  {
    return {};
  }
  void wait(const fake_event<event_part(O)>&, fsdp::milliseconds)
    requires(O != omit::queue_wait)
  {}
  void synchronize(fsdp::milliseconds)
    requires(O != omit::synchronize)
  {}
  template <class B>
    requires(O != omit::release)
  void release(B&&) {}
  template <class F>
    requires HostTasks
  void enqueue(F) {}
};

struct fake_range {};

template <omit O = omit::nothing>
struct fake_device {
  using queue = fake_queue<O>;
  using event = fake_event<event_part(O)>;
  using buffer = fake_buffer<buffer_part(O)>;

  buffer allocate(std::size_t, fsdp::mem_kind)
    requires(O != omit::allocate)
  {
    return {};
  }
  fsdp::memory_stats memory() const
    requires(O != omit::memory)
  {
    return {};
  }
  void reset_peak_memory()
    requires(O != omit::reset_peak_memory)
  {}
  int execution_policy() const
    requires(O != omit::execution_policy)
  {
    return 0;
  }
  void copy_from_host(void*, const void*, std::size_t)
    requires(O != omit::copy_from_host)
  {}
  void copy_to_host(void*, const void*, std::size_t)
    requires(O != omit::copy_to_host)
  {}
  void copy(void*, const void*, std::size_t)
    requires(O != omit::copy)
  {}
  void zero(void*, std::size_t)
    requires(O != omit::zero)
  {}
  event compute_record()
    requires(O != omit::compute_record)
  {
    return {};
  }
  void compute_wait(const event&, fsdp::milliseconds)
    requires(O != omit::compute_wait)
  {}
  fake_range range(const char*)
    requires(O != omit::range)
  {
    return {};
  }
  const char* name() const
    requires(O != omit::name)
  {
    return "fake";
  }
};

// The complete fakes model the concepts.
static_assert(fsdp::event<fake_event<>>);
static_assert(fsdp::device_buffer<fake_buffer<>>);
static_assert(fsdp::queue<fake_queue<>>);
static_assert(fsdp::host_task_queue<fake_queue<omit::nothing, true>>);
static_assert(fsdp::device<fake_device<>>);

// Missing any one member, they do not.
template <omit O>
constexpr bool models_device = fsdp::device<fake_device<O>>;

static_assert(!fsdp::event<fake_event<omit::ready>>);
static_assert(!fsdp::event<fake_event<omit::wait>>);
static_assert(!fsdp::device_buffer<fake_buffer<omit::data>>);
static_assert(!fsdp::device_buffer<fake_buffer<omit::bytes>>);
static_assert(!fsdp::device_buffer<fake_buffer<omit::as>>);
static_assert(!fsdp::device_buffer<fake_buffer<omit::reset>>);
static_assert(!fsdp::queue<fake_queue<omit::launch>>);
static_assert(!fsdp::queue<fake_queue<omit::record>>);
static_assert(!fsdp::queue<fake_queue<omit::queue_wait>>);
static_assert(!fsdp::queue<fake_queue<omit::synchronize>>);
static_assert(fsdp::queue<fake_queue<omit::release>>);  // release() is checked by device
static_assert(!fsdp::host_task_queue<fake_queue<>>);    // no enqueue()
static_assert(!fsdp::host_task_queue<fake_queue<omit::launch, true>>);  // enqueue() but not a queue

// What else the concepts ask for: a copyable, default-constructible event; a movable buffer.
struct event_without_default {
  explicit event_without_default(int) {}
  bool ready() const { return true; }
  void wait(fsdp::milliseconds, std::string_view = "event") const {}
};
static_assert(!fsdp::event<event_without_default>);
struct move_only_event : fake_event<> {
  move_only_event() = default;
  move_only_event(move_only_event&&) = default;
  move_only_event& operator=(move_only_event&&) = default;
};
static_assert(!fsdp::event<move_only_event>);
struct pinned_buffer : fake_buffer<> {
  pinned_buffer() = default;
  pinned_buffer(pinned_buffer&&) = delete;
};
static_assert(!fsdp::device_buffer<pinned_buffer>);
// A queue whose record() returns something other than the device's event.
struct device_with_foreign_event : fake_device<> {
  using event = fsdp::host_event;
  event compute_record() { return {}; }
  void compute_wait(const event&, fsdp::milliseconds) {}
};
static_assert(fsdp::event<device_with_foreign_event::event>);
static_assert(!fsdp::device<device_with_foreign_event>);

}  // namespace

TEST_CASE("device concepts: the host device models them, a fake missing any one member does not") {
  // The static_asserts above decide; this case reports the same facts at run time.
  CHECK(fsdp::device<fsdp::host_device>);
  CHECK(fsdp::host_task_queue<fsdp::host_queue>);
  CHECK(models_device<omit::nothing>);
  CHECK_FALSE(models_device<omit::ready>);
  CHECK_FALSE(models_device<omit::wait>);
  CHECK_FALSE(models_device<omit::data>);
  CHECK_FALSE(models_device<omit::bytes>);
  CHECK_FALSE(models_device<omit::as>);
  CHECK_FALSE(models_device<omit::reset>);
  CHECK_FALSE(models_device<omit::launch>);
  CHECK_FALSE(models_device<omit::record>);
  CHECK_FALSE(models_device<omit::queue_wait>);
  CHECK_FALSE(models_device<omit::synchronize>);
  CHECK_FALSE(models_device<omit::release>);
  CHECK(models_device<omit::enqueue>);  // a capability, not part of device
  CHECK_FALSE(models_device<omit::allocate>);
  CHECK_FALSE(models_device<omit::memory>);
  CHECK_FALSE(models_device<omit::reset_peak_memory>);
  CHECK_FALSE(models_device<omit::execution_policy>);
  CHECK_FALSE(models_device<omit::copy_from_host>);
  CHECK_FALSE(models_device<omit::copy_to_host>);
  CHECK_FALSE(models_device<omit::copy>);
  CHECK_FALSE(models_device<omit::zero>);
  CHECK_FALSE(models_device<omit::compute_record>);
  CHECK_FALSE(models_device<omit::compute_wait>);
  CHECK_FALSE(models_device<omit::range>);
  CHECK_FALSE(models_device<omit::name>);
}
