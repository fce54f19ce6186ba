// Tests of the host device (device/host.hpp): in-order queues with CUDA-stream semantics,
// events, cross-queue waits, failure and timeout behaviour, and the memory accounting.
//
// Blocking tasks wait on a gate the test opens; gates are declared after the queues, so even a
// failing REQUIRE opens them before a queue's destructor drains it.

#include "fsdp/device/host.hpp"

#include <doctest/doctest.h>

#include "common/catch_error.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

// A one-shot gate: tasks wait on a key until the test open()s the gate. The gate opens itself
// when destroyed, so declaring it after the queues (it is then destroyed first) means a failed
// REQUIRE can never leave a queue thread stuck in its destructor. Keys share the state, so a
// task may outlive the gate.
class gate {
  struct state {
    std::mutex m;
    std::condition_variable cv;
    bool open = false;
  };

 public:
  class key {
   public:
    void wait() const {
      std::unique_lock lock(s_->m);
      s_->cv.wait(lock, [&] { return s_->open; });
    }

   private:
    friend class gate;
    explicit key(std::shared_ptr<state> s) : s_(std::move(s)) {}
    std::shared_ptr<state> s_;
  };

  gate() = default;
  gate(const gate&) = delete;
  gate& operator=(const gate&) = delete;
  ~gate() { open(); }
  key get() const { return key(s_); }
  void open() const {
    {
      std::lock_guard lock(s_->m);
      s_->open = true;
    }
    s_->cv.notify_all();
  }

 private:
  std::shared_ptr<state> s_ = std::make_shared<state>();
};

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

using fsdp_test::catch_error;

}  // namespace

TEST_CASE("host_queue runs tasks in the order they were enqueued") {
  std::vector<int> seen;  // touched only by the queue thread until synchronize()
  {
    fsdp::host_queue q("order");
    CHECK(q.name() == "order");
    for (int i = 0; i < 2000; ++i) {
      q.enqueue([&seen, i] {
        if (i % 250 == 0) std::this_thread::sleep_for(1ms);  // give a reordering a chance
        seen.push_back(i);
      });
    }
    q.synchronize(5000ms);
    std::vector<int> expected(2000);
    std::iota(expected.begin(), expected.end(), 0);
    CHECK(seen == expected);
    CHECK_FALSE(q.failure());
  }
}

TEST_CASE("host_queue: tasks run on the queue's own thread, and the destructor drains the queue") {
  const auto caller = std::this_thread::get_id();
  std::thread::id worker{};
  int ran = 0;
  {
    fsdp::host_queue q;
    q.enqueue([&] {
      std::this_thread::sleep_for(20ms);
      worker = std::this_thread::get_id();
    });
    for (int i = 0; i < 100; ++i) q.enqueue([&] { ++ran; });
  }  // ~host_queue runs what is queued, then joins
  CHECK(ran == 100);
  CHECK(worker != std::thread::id{});
  CHECK(worker != caller);
}

TEST_CASE("host_queue: enqueue returns at once even when a task blocks") {
  std::atomic<bool> after{false};
  fsdp::host_queue q;
  gate g;
  const auto t0 = clock_type::now();
  q.enqueue([k = g.get()] { k.wait(); });
  q.enqueue([&] { after = true; });
  const fsdp::host_event e = q.record();
  const double elapsed = ms_since(t0);
  CHECK(elapsed < 200.0);  // the caller did not wait for the blocked task
  std::this_thread::sleep_for(30ms);
  CHECK_FALSE(e.ready());
  CHECK_FALSE(after.load());
  g.open();
  e.wait(5000ms);
  CHECK(e.ready());
  CHECK(after.load());
}

TEST_CASE("host_event: record, ready and wait") {
  SUBCASE("a default event is complete") {
    const fsdp::host_event e;
    CHECK(e.ready());
    CHECK_NOTHROW(e.wait(1ms));
  }
  SUBCASE("an event completes after exactly the work enqueued before it") {
    int stage = 0;  // written by the queue thread; read after waits that order it
    fsdp::host_queue q;
    gate g1, g2;
    q.enqueue([&, k = g1.get()] {
      k.wait();
      stage = 1;
    });
    const fsdp::host_event e1 = q.record();
    q.enqueue([&, k = g2.get()] {
      k.wait();
      stage = 2;
    });
    const fsdp::host_event e2 = q.record();
    std::this_thread::sleep_for(20ms);
    CHECK_FALSE(e1.ready());
    CHECK_FALSE(e2.ready());
    g1.open();
    e1.wait(5000ms);
    CHECK(e1.ready());
    CHECK(stage == 1);  // e1 does not wait for the second task
    std::this_thread::sleep_for(20ms);
    CHECK_FALSE(e2.ready());
    g2.open();
    e2.wait(5000ms);
    CHECK(stage == 2);
    // Copies refer to the same point.
    const fsdp::host_event copy = e2;
    CHECK(copy.ready());
    CHECK_NOTHROW(copy.wait(1ms));
  }
  SUBCASE("an event recorded on an idle queue completes promptly") {
    fsdp::host_queue q;
    const auto t0 = clock_type::now();
    q.record().wait(5000ms);
    CHECK(ms_since(t0) < 1000.0);
  }
}

TEST_CASE("host_queue::wait(event) orders work across queues") {
  int produced = 0;   // written on q1's thread
  int observed = -1;  // written on q2's thread after it waited for q1's event
  fsdp::host_queue q1("producer"), q2("consumer");
  gate g;
  q1.enqueue([&, k = g.get()] {
    k.wait();
    std::this_thread::sleep_for(10ms);
    produced = 42;
  });
  const fsdp::host_event done = q1.record();
  q2.wait(done, 5000ms);
  q2.enqueue([&] { observed = produced; });
  const fsdp::host_event consumed = q2.record();
  std::this_thread::sleep_for(30ms);
  CHECK_FALSE(consumed.ready());  // q2 is held back by q1's event
  g.open();
  consumed.wait(5000ms);
  CHECK(observed == 42);
  // The waiting queue did not block its caller, and q1 is unaffected.
  CHECK(done.ready());
  CHECK_FALSE(q1.failure());
  CHECK_FALSE(q2.failure());
}

TEST_CASE("host_queue: a throwing task fails the queue, drops later tasks, and still completes events") {
  std::vector<int> ran;
  fsdp::host_queue q("failing");
  q.enqueue([&] { ran.push_back(1); });
  const fsdp::host_event before = q.record();
  q.enqueue([] { throw std::runtime_error("task 2 failed"); });
  q.enqueue([&] { ran.push_back(3); });
  const fsdp::host_event after = q.record();
  q.enqueue([&] { ran.push_back(4); });
  const fsdp::host_event later = q.record();

  CHECK_NOTHROW(before.wait(5000ms));  // recorded before the failure: no error
  CHECK_THROWS_WITH_AS(after.wait(5000ms), "task 2 failed", std::runtime_error);
  CHECK(after.ready());
  CHECK_THROWS_WITH_AS(later.wait(5000ms), "task 2 failed", std::runtime_error);
  CHECK_THROWS_WITH_AS(q.synchronize(5000ms), "task 2 failed", std::runtime_error);
  // Work enqueued after the failure is known is dropped as well.
  q.enqueue([&] { ran.push_back(5); });
  CHECK_THROWS_AS(q.synchronize(5000ms), std::runtime_error);
  CHECK(ran == std::vector<int>{1});
  REQUIRE(q.failure());
  CHECK_THROWS_WITH_AS(std::rethrow_exception(q.failure()), "task 2 failed", std::runtime_error);
}

TEST_CASE("host_queue: only the first failure is kept") {
  fsdp::host_queue q;
  q.enqueue([] { throw fsdp::error(fsdp::errc::internal, "first"); });
  q.enqueue([] { throw std::runtime_error("second"); });  // dropped: never runs
  const auto e = catch_error([&] { q.synchronize(5000ms); });
  CHECK(e.code() == fsdp::errc::internal);
  CHECK(std::string(e.what()).find("first") != std::string::npos);
}

TEST_CASE("host_queue::wait on a failed queue's event passes the failure on") {
  std::atomic<bool> ran{false};
  fsdp::host_queue q1, q2;
  q1.enqueue([] { throw std::logic_error("upstream"); });
  q2.wait(q1.record(), 5000ms);
  q2.enqueue([&] { ran = true; });
  CHECK_THROWS_WITH_AS(q2.synchronize(5000ms), "upstream", std::logic_error);
  CHECK_FALSE(ran.load());
}

TEST_CASE("host_event::wait times out with errc::timeout while a task blocks") {
  fsdp::host_queue q("slow");
  gate g;
  q.enqueue([k = g.get()] { k.wait(); });
  const fsdp::host_event e = q.record();
  const auto t0 = clock_type::now();
  const auto err = catch_error([&] { e.wait(150ms); });
  const double elapsed = ms_since(t0);
  CHECK(err.code() == fsdp::errc::timeout);
  CHECK(std::string(err.what()).find("150 ms") != std::string::npos);
  CHECK(elapsed >= 140.0);
  CHECK(elapsed < 2000.0);
  CHECK_FALSE(e.ready());
  // synchronize is bounded the same way and names the queue.
  const auto serr = catch_error([&] { q.synchronize(100ms); });
  CHECK(serr.code() == fsdp::errc::timeout);
  CHECK(std::string(serr.what()).find("slow") != std::string::npos);
  // Once unblocked, the same event completes normally: a timeout is not a queue failure.
  g.open();
  CHECK_NOTHROW(e.wait(5000ms));
  CHECK_NOTHROW(q.synchronize(5000ms));
  CHECK_FALSE(q.failure());
}

TEST_CASE("host_queue::wait on an event that does not complete in time fails the waiting queue") {
  std::atomic<bool> ran{false};
  fsdp::host_queue q1("stuck"), q2("waiter");
  gate g;
  q1.enqueue([k = g.get()] { k.wait(); });
  q2.wait(q1.record(), 100ms);
  q2.enqueue([&] { ran = true; });
  const auto t0 = clock_type::now();
  const auto err = catch_error([&] { q2.synchronize(5000ms); });
  CHECK(err.code() == fsdp::errc::timeout);
  CHECK(std::string(err.what()).find("waiter") != std::string::npos);
  CHECK(ms_since(t0) < 3000.0);
  CHECK_FALSE(ran.load());
  g.open();
  CHECK_NOTHROW(q1.synchronize(5000ms));
}

TEST_CASE("host_queue::synchronize waits for everything enqueued so far") {
  std::atomic<int> done{0};
  fsdp::host_queue q;
  for (int i = 0; i < 20; ++i)
    q.enqueue([&] {
      std::this_thread::sleep_for(1ms);
      ++done;
    });
  q.synchronize(5000ms);
  CHECK(done.load() == 20);
}

TEST_CASE("host_queue accepts move-only tasks") {
  auto p = std::make_unique<int>(7);
  int got = 0;
  fsdp::host_queue q;
  q.enqueue([p = std::move(p), &got] { got = *p; });
  q.synchronize(5000ms);
  CHECK(got == 7);
}

TEST_CASE("host_device: allocations count live, peak, persistent and transient bytes") {
  const fsdp::host_device dev;
  auto s = dev.memory();
  CHECK(s.live == 0);
  CHECK(s.peak == 0);

  auto a = dev.allocate(1000, fsdp::mem_kind::persistent);
  auto b = dev.allocate(300, fsdp::mem_kind::transient);
  {
    auto c = dev.allocate(200, fsdp::mem_kind::transient);
    s = dev.memory();
    CHECK(s.live == 1500);
    CHECK(s.persistent_live == 1000);
    CHECK(s.transient_live == 500);
    CHECK(s.peak == 1500);
    CHECK(s.transient_peak == 500);
    CHECK(c.bytes() == 200);
  }
  s = dev.memory();
  CHECK(s.live == 1300);
  CHECK(s.transient_live == 300);
  CHECK(s.peak == 1500);           // peaks remember
  CHECK(s.transient_peak == 500);

  dev.reset_peak_memory();
  s = dev.memory();
  CHECK(s.peak == 1300);  // a reset peak starts from what is live
  CHECK(s.transient_peak == 300);

  auto d = dev.allocate(50, fsdp::mem_kind::persistent);
  s = dev.memory();
  CHECK(s.peak == 1350);
  CHECK(s.persistent_live == 1050);
  CHECK(s.transient_peak == 300);  // persistent bytes do not count as transient

  a.reset();
  CHECK_FALSE(a);
  CHECK(a.bytes() == 0);
  a.reset();  // twice is harmless
  s = dev.memory();
  CHECK(s.live == 350);
  CHECK(s.persistent_live == 50);
  b = {};
  d = {};
  s = dev.memory();
  CHECK(s.live == 0);
  CHECK(s.persistent_live == 0);
  CHECK(s.transient_live == 0);
  CHECK(s.peak == 1350);
}

TEST_CASE("host_device: a size whose aligned block would wrap throws std::bad_alloc and counts nothing") {
  // (Sizes that fit but no memory can hold would make AddressSanitizer's allocator stop the
  // test instead of failing the allocation, so only the wrapping ones are tried.)
  const fsdp::host_device dev;
  for (std::size_t bytes : {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 63}) {
    INFO(bytes << " bytes");
    CHECK_THROWS_AS(dev.allocate(bytes, fsdp::mem_kind::transient), std::bad_alloc);
    CHECK(dev.memory().live == 0);
  }
}

TEST_CASE("host_device: buffers are zero-filled and 64-byte aligned") {
  const fsdp::host_device dev;
  for (std::size_t bytes : {1u, 3u, 63u, 64u, 65u, 100u, 4096u, 4097u, 1u << 20}) {
    INFO(bytes << " bytes");
    // Dirty a block of the same size first so a reused block would show stale bytes.
    {
      auto dirty = dev.allocate(bytes, fsdp::mem_kind::transient);
      std::memset(dirty.data(), 0xab, bytes);
    }
    auto buf = dev.allocate(bytes, fsdp::mem_kind::transient);
    REQUIRE(buf);
    CHECK(buf.bytes() == bytes);
    CHECK(reinterpret_cast<std::uintptr_t>(buf.data()) % 64 == 0);
    const auto* p = buf.as<unsigned char>();
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
    CHECK(nonzero == 0);
    CHECK(static_cast<void*>(buf.as<float>()) == buf.data());
  }
  // Zero bytes: an empty buffer that counts nothing.
  auto none = dev.allocate(0, fsdp::mem_kind::persistent);
  CHECK_FALSE(none);
  CHECK(dev.memory().live == 0);
}

TEST_CASE("host_device: moving buffers does not double count") {
  const fsdp::host_device dev;
  auto a = dev.allocate(256, fsdp::mem_kind::transient);
  void* const p = a.data();
  fsdp::host_buffer b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.bytes() == 256);
  CHECK_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  CHECK(dev.memory().live == 256);

  fsdp::host_buffer c;
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(dev.memory().live == 256);

  // Move-assigning over a live buffer frees the old one.
  auto d = dev.allocate(100, fsdp::mem_kind::persistent);
  CHECK(dev.memory().live == 356);
  d = std::move(c);
  auto s = dev.memory();
  CHECK(s.live == 256);
  CHECK(s.persistent_live == 0);
  CHECK(s.transient_live == 256);

  std::vector<fsdp::host_buffer> many;
  for (int i = 0; i < 10; ++i) many.push_back(dev.allocate(10, fsdp::mem_kind::transient));  // reallocations move
  CHECK(dev.memory().live == 356);
  many.clear();
  d.reset();
  CHECK(dev.memory().live == 0);
  CHECK(dev.memory().peak == 356);
}

TEST_CASE("host_device: copies share counters, separate devices do not") {
  const fsdp::host_device dev;
  const fsdp::host_device copy = dev;
  const fsdp::host_device other;
  auto a = copy.allocate(128, fsdp::mem_kind::persistent);
  CHECK(dev.memory().live == 128);
  CHECK(other.memory().live == 0);
  auto b = other.allocate(64, fsdp::mem_kind::persistent);
  CHECK(dev.memory().live == 128);
  CHECK(other.memory().live == 64);
}

TEST_CASE("host_device: a buffer freed on a queue thread is counted") {
  const fsdp::host_device dev;
  fsdp::host_queue q;
  for (int round = 0; round < 50; ++round) {
    auto buf = dev.allocate(1024, fsdp::mem_kind::transient);
    std::memset(buf.data(), round, 1024);
    q.enqueue([b = std::move(buf)]() mutable { b.reset(); });
    // Allocations on the caller race with frees on the queue; the counters must stay exact.
    auto other = dev.allocate(16, fsdp::mem_kind::persistent);
  }
  q.synchronize(5000ms);
  const auto s = dev.memory();
  CHECK(s.live == 0);
  CHECK(s.transient_live == 0);
  CHECK(s.persistent_live == 0);
  CHECK(s.peak >= 1024);  // the queue may free a round's buffer before the 16 bytes arrive
  CHECK(s.peak <= 50 * 1024 + 16);
}

TEST_CASE("host_queue::release frees only after the work queued before it, even after a failure") {
  const fsdp::host_device dev;
  fsdp::host_queue q;
  gate g;
  std::atomic<std::uint64_t> seen_by_task{0};
  // A task is running (blocked) and one is queued behind it: the free rides on the queued one.
  q.enqueue([k = g.get()] { k.wait(); });
  auto used = dev.allocate(4096, fsdp::mem_kind::transient);
  q.enqueue([&, p = used.data()] {
    static_cast<char*>(p)[0] = 1;  // reads and writes the buffer: it must still be alive
    seen_by_task = dev.memory().transient_live;
  });
  q.release(std::move(used));
  CHECK(dev.memory().transient_live == 4096);
  g.open();
  q.synchronize(5000ms);
  CHECK(seen_by_task == 4096);
  CHECK(dev.memory().transient_live == 0);
  // An idle queue: a task of its own.
  q.release(dev.allocate(512, fsdp::mem_kind::transient));
  q.synchronize(5000ms);
  CHECK(dev.memory().transient_live == 0);
  // A failed queue drops the task the free rode on, and still frees the buffer.
  fsdp::host_queue failing;
  failing.enqueue([] { throw std::runtime_error("boom"); });
  failing.enqueue([] {});
  failing.release(dev.allocate(256, fsdp::mem_kind::transient));
  CHECK_THROWS(failing.synchronize(5000ms));
  CHECK(dev.memory().transient_live == 0);
}

TEST_CASE("host_device: compute runs on the caller") {
  const fsdp::host_device dev;
  CHECK(std::string(fsdp::host_device::name()) == "host");
  CHECK(dev.compute_record().ready());
  // compute_wait blocks the caller until a queue's event completes.
  std::atomic<bool> done{false};
  fsdp::host_queue q;
  gate g, g2;
  q.enqueue([&, k = g.get()] {
    k.wait();
    done = true;
  });
  const auto e = q.record();
  {
    std::jthread opener([&g] {
      std::this_thread::sleep_for(30ms);
      g.open();
    });
    dev.compute_wait(e, 5000ms);
    CHECK(done.load());
  }
  // And it times out like an event wait.
  q.enqueue([k = g2.get()] { k.wait(); });
  const auto e2 = q.record();
  const auto err = catch_error([&] { dev.compute_wait(e2, 50ms); });
  CHECK(err.code() == fsdp::errc::timeout);
  g2.open();
}

TEST_CASE("queue_wake::on_wait: the waiting thread runs queue_or_waiter tasks; the queue's thread the rest") {
  const auto caller = std::this_thread::get_id();
  fsdp::host_queue q("waited", fsdp::queue_wake::on_wait);
  CHECK(q.wake() == fsdp::queue_wake::on_wait);
  std::vector<std::thread::id> ran;  // written by whichever thread runs the task, one at a time
  auto note = [&ran] { ran.push_back(std::this_thread::get_id()); };

  SUBCASE("issue and wait: every task up to the event runs on the waiter, in order") {
    std::vector<int> order;
    for (int i = 0; i < 3; ++i)
      q.enqueue([&, i] {
        note();
        order.push_back(i);
      }, fsdp::run_on::queue_or_waiter);
    const auto e = q.record();
    std::this_thread::sleep_for(20ms);
    CHECK_FALSE(e.ready());  // nothing woke the queue's thread
    e.wait(5000ms);
    CHECK(order == std::vector<int>{0, 1, 2});
    for (auto id : ran) CHECK(id == caller);
  }
  SUBCASE("a queue_thread task wakes the queue's thread, which runs the waiting tasks before it") {
    q.enqueue(note, fsdp::run_on::queue_or_waiter);
    q.enqueue(note);  // queue_thread
    const auto e = q.record();
    const auto t0 = clock_type::now();
    while (!e.ready() && ms_since(t0) < 5000.0) std::this_thread::sleep_for(1ms);
    REQUIRE(e.ready());  // without any wait
    REQUIRE(ran.size() == 2);
    CHECK(ran[0] != caller);
    CHECK(ran[1] != caller);
  }
  SUBCASE("the waiter stops at a task only the queue's thread may run, which then runs there") {
    q.enqueue(note, fsdp::run_on::queue_or_waiter);
    q.enqueue(note);
    q.enqueue(note, fsdp::run_on::queue_or_waiter);
    q.synchronize(5000ms);
    REQUIRE(ran.size() == 3);
    CHECK(ran[1] != caller);
  }
  SUBCASE("a wait runs the tasks before its event and none after; a later failure is not its own") {
    std::vector<int> order;
    auto task = [&](int i) {
      return [&, i] {
        note();
        order.push_back(i);
      };
    };
    q.enqueue(task(0), fsdp::run_on::queue_or_waiter);
    q.enqueue(task(1), fsdp::run_on::queue_or_waiter);
    const auto first = q.record();
    q.enqueue(task(2), fsdp::run_on::queue_or_waiter);
    q.enqueue([] { throw std::runtime_error("a later task failed"); }, fsdp::run_on::queue_or_waiter);
    const auto second = q.record();
    first.wait(5000ms);
    CHECK(order == std::vector<int>{0, 1});
    CHECK_FALSE(second.ready());
    CHECK_THROWS_WITH_AS(second.wait(5000ms), "a later task failed", std::runtime_error);
    CHECK(order == std::vector<int>{0, 1, 2});
    CHECK_NOTHROW(first.wait(5000ms));  // its tasks all ran before the failure
    CHECK(q.record().ready());          // nothing is left to run; the failure stays the queue's
    CHECK_THROWS_WITH_AS(q.record().wait(5000ms), "a later task failed", std::runtime_error);
  }
  SUBCASE("a task that throws on the waiter fails the queue as on its thread") {
    q.enqueue([] { throw std::runtime_error("waited task failed"); }, fsdp::run_on::queue_or_waiter);
    q.enqueue(note, fsdp::run_on::queue_or_waiter);  // dropped
    const auto e = q.record();
    CHECK_THROWS_WITH_AS(e.wait(5000ms), "waited task failed", std::runtime_error);
    CHECK(ran.empty());
    CHECK(q.failure());
  }
}

TEST_CASE("queue_wake::on_wait: the destructor runs tasks nobody waited for") {
  std::atomic<int> ran{0};
  {
    fsdp::host_queue q("waited", fsdp::queue_wake::on_wait);
    for (int i = 0; i < 5; ++i) q.enqueue([&] { ++ran; }, fsdp::run_on::queue_or_waiter);
  }
  CHECK(ran.load() == 5);
}

TEST_CASE("queue_wake::on_enqueue (the default): queue_or_waiter tasks still run on the queue's thread") {
  const auto caller = std::this_thread::get_id();
  std::thread::id ran{};
  fsdp::host_queue q;
  CHECK(q.wake() == fsdp::queue_wake::on_enqueue);
  q.enqueue([&] { ran = std::this_thread::get_id(); }, fsdp::run_on::queue_or_waiter);
  q.synchronize(5000ms);
  CHECK(ran != std::thread::id{});
  CHECK(ran != caller);
}

TEST_CASE("queue_wake::on_wait: a wait behind a task the waiter may not run times out as on any queue") {
  fsdp::host_queue q("waited", fsdp::queue_wake::on_wait);
  gate g;
  q.enqueue([k = g.get()] { k.wait(); });  // queue_thread: blocks the queue's thread
  q.enqueue([] {}, fsdp::run_on::queue_or_waiter);
  const fsdp::host_event e = q.record();
  const auto t0 = clock_type::now();
  const auto err = catch_error([&] { e.wait(100ms, "the gated event"); });
  CHECK(err.code() == fsdp::errc::timeout);
  CHECK(std::string(err.what()).find("the gated event") != std::string::npos);
  CHECK(ms_since(t0) >= 90.0);
  g.open();
  CHECK_NOTHROW(e.wait(5000ms));
}
