// Tests of detail::block_cache (device/block_cache.hpp), the cache of an outside memory source's
// blocks behind cuda_device::use_memory, against its numbered contract, with marks on fake
// streams whose progress the test drives (on a GPU, tests/cuda checks it with CUDA's events).

#include "fsdp/device/block_cache.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/catch_error.hpp"

namespace {

using namespace std::chrono_literals;
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A stream: work is queued on it (record) and completes when the test says so.
struct fake_stream {
  std::atomic<long> queued{0}, completed{0};
  bool capturing = false;
  bool fail_records = false;
  void run_all() { completed = queued.load(); }
};

// A mark: a point of a fake stream; done once the stream completed that far.
struct fake_mark {
  fake_stream* s = nullptr;
  long at = 0;
  int id = 0;  // 0: none (block_cache compares with a default mark)
  bool operator==(const fake_mark& o) const { return id == o.id; }
};

struct fake_marks {
  using stream = fake_stream*;
  using mark = fake_mark;
  static inline std::atomic<int> made{0}, destroyed{0}, waits{0};
  static mark create() noexcept { return {nullptr, 0, ++made}; }
  static bool record(mark& m, stream s) noexcept {
    if (s->fail_records) return false;
    m.s = s;
    m.at = ++s->queued;
    return true;
  }
  static bool capturing(stream s) noexcept { return s->capturing; }
  static bool done(mark m) { return m.s->completed >= m.at; }
  static bool wait(mark m, fsdp::milliseconds timeout) noexcept {
    ++waits;
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!done(m)) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }
  static void destroy(mark) noexcept { ++destroyed; }
};
using cache = fsdp::detail::block_cache<fake_marks>;

// A source over malloc that counts its blocks (given, taken back), or fails.
struct counted {
  std::shared_ptr<std::atomic<long>> given = std::make_shared<std::atomic<long>>(0), back = std::make_shared<std::atomic<long>>(0);
  fsdp::memory_source source(bool fail = false, bool null = false) const {
    return {"counted malloc",
            [g = given, fail, null](std::size_t bytes) -> void* {
              if (fail) throw fsdp::error(fsdp::errc::internal, "out of counted memory");
              if (null) return nullptr;
              ++*g;
              return std::malloc(bytes);
            },
            [b = back](void* p) {
              ++*b;
              std::free(p);
            }};
  }
};

}  // namespace

TEST_CASE("block_cache 1-3: a released block is handed out again, for its size only, once its release has completed; "
          "nothing waits") {
  counted c;
  fake_stream s;
  const int waits_before = fake_marks::waits;
  {
    cache k(c.source(), 50ms);
    CHECK(k.name() == "counted malloc");
    void* a = k.take(64);
    CHECK(*c.given == 1);
    k.give(a, &s);  // its release: queued on s, not yet completed
    void* b = k.take(64);
    CHECK(b != a);  // contract 1: not while the release is pending
    CHECK(*c.given == 2);
    s.run_all();
    void* d = k.take(128);
    CHECK(*c.given == 3);  // another size: a new block, though a's is free
    CHECK(d != a);
    void* e = k.take(64);
    CHECK(e == a);  // its release completed: a's block again
    CHECK(*c.given == 3);
    void* f = k.take(64);  // a and b both in use: a new one
    CHECK(*c.given == 4);
    CHECK(k.holding().blocks == 4);
    CHECK(k.holding().bytes == 3 * 64 + 128);
    CHECK(f != a);
    CHECK(f != b);
    for (void* p : {b, d, e, f}) k.give(p, &s);
    CHECK(fake_marks::waits == waits_before);  // contract 3: asked, never waited for
    s.run_all();
  }
  CHECK(*c.back == 4);  // contract 4: every block back with the cache
}

TEST_CASE("block_cache 2: a block released in a capture, or whose release cannot be recorded, is retired: never "
          "handed out again, returned with the cache") {
  counted c;
  fake_stream captured, broken, s;
  captured.capturing = true;
  broken.fail_records = true;
  {
    cache k(c.source(), 50ms);
    void* a = k.take(32);
    void* b = k.take(32);
    k.give(a, &captured);
    k.give(b, &broken);
    captured.run_all();
    broken.run_all();
    void* x = k.take(32);
    CHECK(x != a);
    CHECK(x != b);
    CHECK(*c.given == 3);
    k.give(x, &s);
    s.run_all();
  }
  CHECK(*c.back == 3);
}

TEST_CASE("block_cache 4: at teardown a block whose release has not completed within the time is left unreturned; "
          "the others go back; one deadline for all") {
  counted c;
  fake_stream s, stuck;
  const int destroyed_before = fake_marks::destroyed;
  std::vector<void*> left;
  std::optional<cache> k;
  k.emplace(c.source(), 50ms);
  void* a = k->take(16);
  for (int i = 0; i < 20; ++i) left.push_back(k->take(16));
  void* d = k->take(24);
  k->give(a, &s);
  for (void* p : left) k->give(p, &stuck);  // never completes
  k->give(d, &s);
  s.run_all();
  const auto t0 = std::chrono::steady_clock::now();
  k.reset();
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took < 500ms);  // 20 stuck blocks at 50 ms each would take a second
  CHECK(*c.given == 22);
  CHECK(*c.back == 2);
  CHECK(fake_marks::destroyed - destroyed_before == 22);  // every mark goes, returned or not
  for (void* p : left) std::free(p);  // the ones the cache left: the test's to return
}

TEST_CASE("block_cache: a source that fails or gives nothing, and one without allocate or free, are refused by name; "
          "nothing is held") {
  counted c;
  {
    cache k(c.source(true));
    const fsdp::error e = fsdp_test::catch_error([&] { k.take(8); });
    CHECK(e.code() == fsdp::errc::internal);
    CHECK(contains(e.what(), "out of counted memory"));
  }
  {
    cache k(c.source(false, true));
    const fsdp::error e = fsdp_test::catch_error([&] { k.take(8); });
    CHECK(e.code() == fsdp::errc::internal);
    CHECK(contains(e.what(), "the memory source 'counted malloc' returned no memory for 8 bytes"));
  }
  CHECK(*c.back == 0);
  const fsdp::error half = fsdp_test::catch_error([] { cache k({"half", [](std::size_t) -> void* { return nullptr; }, {}}); });
  CHECK(half.code() == fsdp::errc::invalid_argument);
  CHECK(contains(half.what(), "the memory source 'half' needs both allocate and free"));
}

TEST_CASE("block_cache 5: threads taking and giving at once never share a block") {
  counted c;
  constexpr int threads = 4, rounds = 2000;
  std::vector<fake_stream> streams(threads);
  std::mutex m;
  std::set<void*> in_use;
  std::atomic<int> shared{0};
  const int waits_before = fake_marks::waits;
  {
    cache k(c.source(), 50ms);
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        for (int r = 0; r < rounds; ++r) {
          void* p = k.take(static_cast<std::size_t>(64 << (r % 3)));
          {
            std::lock_guard lock(m);
            if (!in_use.insert(p).second) ++shared;
          }
          std::this_thread::yield();  // hold it a while: a block handed out twice is then in two threads' hands
          {
            std::lock_guard lock(m);
            in_use.erase(p);
          }
          k.give(p, &streams[static_cast<std::size_t>(t)]);
          streams[static_cast<std::size_t>(t)].run_all();
        }
      });
    for (auto& t : ts) t.join();
    CHECK(fake_marks::waits == waits_before);  // contract 3
  }
  CHECK(shared == 0);
  // Reused: per size at most a block in each thread's hands and one whose release is pending.
  CHECK(*c.given <= threads * 2 * 3);
  CHECK(*c.back == *c.given);
}
