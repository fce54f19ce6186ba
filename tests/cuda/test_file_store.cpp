// Tests of fsdp::file_store (comm/file_store.hpp), the rendezvous through which NCCL ranks
// receive rank 0's unique id: exchange between threads, timeouts, rejected files, key rules.

#include "fsdp/comm/file_store.hpp"

#include <doctest/doctest.h>

#include "common/catch_error.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "fsdp/core/error.hpp"

namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed at the end of the test.
struct temp_dir {
  fs::path path;
  temp_dir() {
    static std::atomic<int> n{0};
    path = fs::temp_directory_path() / ("fsdp_test_store_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<std::byte> bytes(std::size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(seed)) & 0xff);
  return v;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("file_store: two threads exchange a 128-byte id through a directory") {
  temp_dir dir;
  const auto id = bytes(128, 7);  // the size of an ncclUniqueId
  std::vector<std::byte> got;
  std::thread reader([&] { got = fsdp::file_store{dir.path}.get("nccl_id", 10s); });  // starts first: polls
  std::this_thread::sleep_for(50ms);
  fsdp::file_store{dir.path}.set("nccl_id", id);
  reader.join();
  CHECK(got == id);
}

TEST_CASE("file_store: a value that was never written times out, naming the file") {
  temp_dir dir;
  fsdp::file_store store{dir.path};
  const auto start = std::chrono::steady_clock::now();
  const fsdp::error e = fsdp_test::catch_error([&] { store.get("nccl_id", 100ms); });
  CHECK(std::chrono::steady_clock::now() - start >= 100ms);
  CHECK(e.code() == fsdp::errc::timeout);
  CHECK(contains(e.what(), store.path("nccl_id").string()));
  CHECK(contains(e.what(), "not written within 100 ms"));
}

TEST_CASE("file_store: a truncated or foreign file is rejected") {
  temp_dir dir;
  fsdp::file_store store{dir.path};
  store.set("nccl_id", bytes(128, 1));
  SUBCASE("cut short") { fs::resize_file(store.path("nccl_id"), 16 + 100); }
  SUBCASE("shorter than the header") { fs::resize_file(store.path("nccl_id"), 3); }
  SUBCASE("not written by file_store") {
    std::FILE* f = std::fopen(store.path("nccl_id").c_str(), "wb");
    REQUIRE(f);
    const std::array<char, 144> junk{};
    std::fwrite(junk.data(), 1, junk.size(), f);
    std::fclose(f);
  }
  const fsdp::error e = fsdp_test::catch_error([&] { store.get("nccl_id", 1s); });
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK(contains(e.what(), "truncated or was not written by fsdp::file_store"));
}

TEST_CASE("file_store: set replaces a value atomically and leaves no temporary file") {
  temp_dir dir;
  fsdp::file_store store{dir.path};
  store.set("k", bytes(10, 1));
  store.set("k", bytes(3, 2));
  store.set("empty", {});
  CHECK(store.get("k", 1s) == bytes(3, 2));
  CHECK(store.get("empty", 1s).empty());
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path)) {
    ++files;
    CHECK(!contains(entry.path().filename().string(), ".tmp."));
  }
  CHECK(files == 2);
  CHECK(store.remove("k"));
  CHECK(!store.remove("k"));
}

TEST_CASE("file_store: many writers and readers of one key see whole values") {
  temp_dir dir;
  fsdp::file_store store{dir.path};
  std::atomic<bool> bad{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        if (t % 2 == 0) {
          store.set("shared", bytes(64, t));
        } else {
          try {
            const auto v = store.get("shared", 5s, 1ms);
            if (v != bytes(64, 0) && v != bytes(64, 2)) bad = true;
          } catch (...) {
            bad = true;
          }
        }
      }
    });
  for (auto& th : threads) th.join();
  CHECK(!bad);
}

TEST_CASE("file_store: keys are single plain file names") {
  temp_dir dir;
  fsdp::file_store store{dir.path};
  for (const char* key : {"", ".", "..", "../escape", "a/b", "sp ace"}) {
    CAPTURE(key);
    const fsdp::error e = fsdp_test::catch_error([&] { store.set(key, bytes(1, 0)); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
  }
}

TEST_CASE("file_store: a directory that cannot be created is reported") {
  temp_dir dir;
  fsdp::file_store store{dir.path};
  store.set("file", bytes(1, 0));
  const fsdp::error e = fsdp_test::catch_error([&] { fsdp::file_store{store.path("file") / "sub"}; });
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK(contains(e.what(), "cannot create directory"));
}
