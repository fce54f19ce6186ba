// Tests of the threads backend (comm/threads.hpp): every collective for N = 1..8 ranks and the
// floating dtypes, in and out of place, against plain loops over the known per-rank inputs;
// split and barrier; the traffic counters; and the failure model (mismatch, a rank that leaves,
// a stuck rank, a throwing rank, bad arguments), each bounded in time to prove it cannot hang.
//
// Ranks only record what they saw; every check runs on the test thread after world::run.

#include "fsdp/comm/threads.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/catch_error.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace {

using namespace std::chrono_literals;
using fsdp::dtype;
using fsdp::milliseconds;
using comm_t = fsdp::threads::communicator;
using clock_type = std::chrono::steady_clock;

// Timeout for runs that must succeed: long, so a slow sanitizer build never trips it.
constexpr milliseconds generous = 20000ms;
// Timeout for runs that are meant to time out: short, so the test stays fast.
constexpr milliseconds short_timeout = 300ms;
// Upper bound on how long a failing run may take (proves it did not hang).
constexpr double hang_bound_ms = 5000.0;

fsdp::threads::world make_world(int n, milliseconds timeout = generous) {
  return fsdp::threads::world{n, {.timeout = timeout}};
}

template <class T>
T make(double v) {
  if constexpr (std::is_same_v<T, fsdp::bf16>) return __float2bfloat16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, fsdp::f16>) return __float2half(static_cast<float>(v));
  else return static_cast<T>(v);
}
template <class T>
double val(T x) {
  if constexpr (std::is_same_v<T, fsdp::bf16>) return static_cast<double>(__bfloat162float(x));
  else if constexpr (std::is_same_v<T, fsdp::f16>) return static_cast<double>(__half2float(x));
  else return static_cast<double>(x);
}
// Relative tolerance of one rounding to T (for averages, which need not be representable).
template <class T>
double rel_tol() {
  if constexpr (std::is_same_v<T, fsdp::bf16>) return 1.0 / 256;
  else if constexpr (std::is_same_v<T, fsdp::f16>) return 1.0 / 1024;
  else if constexpr (std::is_same_v<T, float>) return 1e-6;
  else return 1e-12;
}

// Rank r's k-th input: multiples of 0.5 in [-2.5, 7], so inputs and all sums over up to 8 ranks
// are exact in every floating dtype (bf16 has 8 significant bits).
double input(int r, std::size_t k) { return 0.5 * (r + 1) + static_cast<double>(k % 7) - 3.0; }

template <class F>
void for_each_float_type(F&& f) {
  f(float{});
  f(fsdp::bf16{});
  f(fsdp::f16{});
  f(double{});
}

std::string type_name(dtype t) { return std::string(fsdp::to_string(t)); }

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

struct outcome {
  std::exception_ptr error;
  double ms = 0;
};
template <class F>
outcome run_world(int n, milliseconds timeout, F&& f) {
  const auto t0 = clock_type::now();
  outcome o;
  try {
    make_world(n, timeout).run(f);
  } catch (...) {
    o.error = std::current_exception();
  }
  o.ms = ms_since(t0);
  return o;
}

// The fsdp::error inside p; fails the test if p holds nothing or something else.
fsdp::error as_fsdp_error(const std::exception_ptr& p) {
  REQUIRE_MESSAGE(static_cast<bool>(p), "expected world::run to throw");
  try {
    std::rethrow_exception(p);
  } catch (const fsdp::error& e) {
    return e;
  } catch (const std::exception& e) {
    FAIL("expected an fsdp::error, got: " << e.what());
  } catch (...) {
    FAIL("expected an fsdp::error, got a non-std exception");
  }
  return fsdp::error(fsdp::errc::internal, "unreachable");
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Floats in pages of their own: release() unmaps them, so a later read by anyone faults
// (SIGSEGV) even without a sanitizer. For the tests that free a buffer after a failed collective.
class mapped_floats {
 public:
  explicit mapped_floats(std::size_t n) : bytes_(n * sizeof(float)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    p_ = static_cast<float*>(p);
  }
  mapped_floats(const mapped_floats&) = delete;
  mapped_floats& operator=(const mapped_floats&) = delete;
  ~mapped_floats() { release(); }
  float* data() const noexcept { return p_; }
  void release() noexcept {
    if (p_) munmap(p_, bytes_);
    p_ = nullptr;
  }

 private:
  std::size_t bytes_;
  float* p_ = nullptr;
};

// ---- collective checks, one world per call ---------------------------------------------------

template <class T>
void check_all_gather(int n, std::size_t count, bool in_place) {
  const dtype t = fsdp::dtype_of<T>;
  INFO("all_gather N=" << n << " count=" << count << " " << type_name(t) << (in_place ? " in place" : ""));
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    const int r = c.rank();
    std::vector<T> recv(static_cast<std::size_t>(n) * count, make<T>(-99.0));
    std::vector<T> send(count);
    for (std::size_t k = 0; k < count; ++k) send[k] = make<T>(input(r, k));
    const void* src = send.data();
    if (in_place) {
      std::copy(send.begin(), send.end(), recv.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * count));
      src = recv.data() + static_cast<std::size_t>(r) * count;
    }
    c.all_gather(src, recv.data(), count, t, q).wait(c.timeout());
    out[static_cast<std::size_t>(r)] = std::move(recv);
  });
  std::size_t wrong = 0;
  for (int r = 0; r < n; ++r) {
    const auto& got = out[static_cast<std::size_t>(r)];
    REQUIRE(got.size() == static_cast<std::size_t>(n) * count);
    for (int j = 0; j < n; ++j)
      for (std::size_t k = 0; k < count; ++k)
        wrong += val(got[static_cast<std::size_t>(j) * count + k]) != input(j, k);
  }
  CHECK(wrong == 0);
}

// Checks every rank's reduced output against the sum (or mean) of the known inputs; element k
// of rank r's output reduces input element offset(r, k) of every rank. A mean must also differ
// from the sum wherever the sum is non-zero (a sum-for-average bug cannot pass).
template <class T, class Offset>
void check_reduced(const std::vector<std::vector<T>>& out, int n, std::size_t count, fsdp::reduce_op op, Offset offset) {
  std::size_t wrong = 0, differs_from_sum = 0, nonzero_sums = 0;
  for (int r = 0; r < n; ++r) {
    const auto& got = out[static_cast<std::size_t>(r)];
    REQUIRE(got.size() == count);
    for (std::size_t k = 0; k < count; ++k) {
      double sum = 0;
      for (int j = 0; j < n; ++j) sum += input(j, offset(r, k));
      const double g = val(got[k]);
      if (op == fsdp::reduce_op::sum) {
        wrong += g != sum;
      } else {
        const double mean = sum / n;
        wrong += std::fabs(g - mean) > std::fabs(mean) * rel_tol<T>() + 1e-12;
        if (sum != 0) {
          ++nonzero_sums;
          differs_from_sum += g != sum;
        }
      }
    }
  }
  CHECK(wrong == 0);
  if (op == fsdp::reduce_op::avg && n > 1) CHECK(differs_from_sum == nonzero_sums);
}

template <class T>
void check_reduce_scatter(int n, std::size_t count, fsdp::reduce_op op, bool in_place) {
  const dtype t = fsdp::dtype_of<T>;
  INFO("reduce_scatter N=" << n << " count=" << count << " " << type_name(t) << " "
                           << fsdp::to_string(op) << (in_place ? " in place" : ""));
  const std::size_t total = static_cast<std::size_t>(n) * count;
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    const int r = c.rank();
    std::vector<T> send(total);
    for (std::size_t k = 0; k < total; ++k) send[k] = make<T>(input(r, k));
    std::vector<T> recv(count, make<T>(-99.0));
    void* dst = in_place ? static_cast<void*>(send.data() + static_cast<std::size_t>(r) * count) : recv.data();
    c.reduce_scatter(send.data(), dst, count, t, op, q).wait(c.timeout());
    if (in_place)
      recv.assign(send.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * count),
                  send.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r + 1) * count));
    out[static_cast<std::size_t>(r)] = std::move(recv);
  });
  check_reduced(out, n, count, op, [count](int r, std::size_t k) { return static_cast<std::size_t>(r) * count + k; });
}

template <class T>
void check_all_reduce(int n, std::size_t count, fsdp::reduce_op op, bool in_place) {
  const dtype t = fsdp::dtype_of<T>;
  INFO("all_reduce N=" << n << " count=" << count << " " << type_name(t) << " " << fsdp::to_string(op)
                       << (in_place ? " in place" : ""));
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    const int r = c.rank();
    std::vector<T> send(count);
    for (std::size_t k = 0; k < count; ++k) send[k] = make<T>(input(r, k));
    std::vector<T> recv(count, make<T>(-99.0));
    void* dst = in_place ? static_cast<void*>(send.data()) : recv.data();
    c.all_reduce(send.data(), dst, count, t, op, q).wait(c.timeout());
    out[static_cast<std::size_t>(r)] = in_place ? std::move(send) : std::move(recv);
  });
  check_reduced(out, n, count, op, [](int, std::size_t k) { return k; });
}

template <class T>
void check_broadcast(int n, std::size_t count, int root) {
  const dtype t = fsdp::dtype_of<T>;
  INFO("broadcast N=" << n << " count=" << count << " " << type_name(t) << " root=" << root);
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    const int r = c.rank();
    std::vector<T> buf(count, make<T>(-77.0));
    if (r == root)
      for (std::size_t k = 0; k < count; ++k) buf[k] = make<T>(input(r, k));
    c.broadcast(buf.data(), count, t, root, q).wait(c.timeout());
    out[static_cast<std::size_t>(r)] = std::move(buf);
  });
  std::size_t wrong = 0;
  for (int r = 0; r < n; ++r) {
    const auto& got = out[static_cast<std::size_t>(r)];
    REQUIRE(got.size() == count);
    for (std::size_t k = 0; k < count; ++k) wrong += val(got[k]) != input(root, k);
  }
  CHECK(wrong == 0);
}

}  // namespace

// ---- collectives ---------------------------------------------------------------------------

TEST_CASE("all_gather: recv holds every rank's send in rank order, N = 1..8") {
  for (int n = 1; n <= 8; ++n)
    for_each_float_type([&](auto x) {
      using T = decltype(x);
      for (std::size_t count : {1u, 13u}) {
        check_all_gather<T>(n, count, false);
        check_all_gather<T>(n, count, true);
      }
    });
}

TEST_CASE("all_gather copies bytes exactly for any dtype") {
  // Random bit patterns (NaNs, subnormals) as f32, and the integer dtypes that cannot be reduced
  // but can be gathered.
  for (int n : {1, 2, 3, 5, 8}) {
    for (dtype t : {dtype::f32, dtype::i32, dtype::i64, dtype::u8, dtype::bf16}) {
      INFO("N=" << n << " " << type_name(t));
      const std::size_t count = 37;
      const std::size_t bytes = count * fsdp::size_of(t);
      auto pattern = [&](int r) {
        std::mt19937 rng(static_cast<unsigned>(1000 + r));
        std::vector<unsigned char> v(bytes);
        for (auto& b : v) b = static_cast<unsigned char>(rng());
        return v;
      };
      std::vector<std::vector<unsigned char>> out(static_cast<std::size_t>(n));
      make_world(n).run([&](comm_t& c) {
        fsdp::host_queue q;
        const auto send = pattern(c.rank());
        std::vector<unsigned char> recv(bytes * static_cast<std::size_t>(n), 0);
        c.all_gather(send.data(), recv.data(), count, t, q).wait(c.timeout());
        out[static_cast<std::size_t>(c.rank())] = std::move(recv);
      });
      std::vector<unsigned char> expected;
      for (int j = 0; j < n; ++j) {
        const auto p = pattern(j);
        expected.insert(expected.end(), p.begin(), p.end());
      }
      for (int r = 0; r < n; ++r) CHECK(out[static_cast<std::size_t>(r)] == expected);
    }
  }
}

TEST_CASE("reduce_scatter sum and avg: rank r gets op over ranks of its chunk, N = 1..8") {
  for (int n = 1; n <= 8; ++n)
    for_each_float_type([&](auto x) {
      using T = decltype(x);
      for (auto op : {fsdp::reduce_op::sum, fsdp::reduce_op::avg}) {
        check_reduce_scatter<T>(n, 11, op, false);
        check_reduce_scatter<T>(n, 11, op, true);
      }
      check_reduce_scatter<T>(n, 1, fsdp::reduce_op::sum, false);
    });
}

// Rank r contributes 3(r + 1) everywhere: over 3 ranks the sum is 18 and the mean 6, exact in
// every dtype. `issue(c, q, buf)` runs the collective, leaving this rank's result in buf.
template <class Issue>
void check_mean_of_three(std::size_t in, std::size_t out_count, Issue issue) {
  for_each_float_type([&](auto x) {
    using T = decltype(x);
    INFO(type_name(fsdp::dtype_of<T>));
    std::vector<std::vector<T>> out(3);
    make_world(3).run([&](comm_t& c) {
      fsdp::host_queue q;
      std::vector<T> buf(in, make<T>(3.0 * (c.rank() + 1)));
      issue(c, q, buf);
      buf.resize(out_count);
      out[static_cast<std::size_t>(c.rank())] = buf;
    });
    for (const auto& v : out)
      for (const T& y : v) CHECK(val(y) == 6.0);
  });
}

// The backend sums straight into the destination unless a peer still reads it; here every
// rank's destination is the start of its own send buffer, which rank 0 reads (chunk 0) and, for
// all_reduce, shifted by one element against the chunks. Written early, the peers would sum
// overwritten inputs (and TSan would see the race).
TEST_CASE("reduce_scatter and all_reduce into a send buffer's part that peers read: the sums of the inputs") {
  const int n = 4;
  const std::size_t count = 5000;  // over the summation's 2048-element blocks
  std::vector<std::vector<float>> rs(n), ar(n);
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    const int r = c.rank();
    std::vector<float> send(n * count);
    for (std::size_t k = 0; k < send.size(); ++k) send[k] = static_cast<float>(input(r, k));
    c.reduce_scatter(send.data(), send.data(), count, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
    rs[static_cast<std::size_t>(r)].assign(send.begin(), send.begin() + count);
    std::vector<float> buf(count + 1);
    for (std::size_t k = 0; k < count; ++k) buf[k] = static_cast<float>(input(r, k));
    c.all_reduce(buf.data(), buf.data() + 1, count, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
    ar[static_cast<std::size_t>(r)].assign(buf.begin() + 1, buf.end());
  });
  check_reduced(rs, n, count, fsdp::reduce_op::sum, [count](int r, std::size_t k) { return static_cast<std::size_t>(r) * count + k; });
  check_reduced(ar, n, count, fsdp::reduce_op::sum, [](int, std::size_t k) { return k; });
}

TEST_CASE("reduce_scatter avg over 3 ranks is the mean, not the sum") {
  check_mean_of_three(3 * 4, 4, [](comm_t& c, fsdp::host_queue& q, auto& buf) {
    using T = typename std::decay_t<decltype(buf)>::value_type;
    std::vector<T> recv(4);
    c.reduce_scatter(buf.data(), recv.data(), 4, fsdp::dtype_of<T>, fsdp::reduce_op::avg, q).wait(c.timeout());
    std::copy(recv.begin(), recv.end(), buf.begin());
  });
}

TEST_CASE("all_reduce sum and avg, in and out of place, N = 1..8") {
  for (int n = 1; n <= 8; ++n)
    for_each_float_type([&](auto x) {
      using T = decltype(x);
      for (auto op : {fsdp::reduce_op::sum, fsdp::reduce_op::avg})
        for (bool in_place : {false, true}) {
          check_all_reduce<T>(n, 16, op, in_place);
          check_all_reduce<T>(n, 7, op, in_place);  // not a multiple of N for N > 1 (e.g. 4)
        }
      check_all_reduce<T>(n, 1, fsdp::reduce_op::sum, false);  // fewer elements than ranks
      check_all_reduce<T>(n, 3, fsdp::reduce_op::avg, true);
    });
}

TEST_CASE("all_reduce avg over 3 ranks is the mean, not the sum") {
  check_mean_of_three(5, 5, [](comm_t& c, fsdp::host_queue& q, auto& buf) {
    using T = typename std::decay_t<decltype(buf)>::value_type;
    c.all_reduce(buf.data(), buf.data(), 5, fsdp::dtype_of<T>, fsdp::reduce_op::avg, q).wait(c.timeout());
  });
}

TEST_CASE("all_reduce adds ranks in rank order in float, bit for bit") {
  // Random floats of mixed magnitudes: the sum depends on the order of the additions, so this
  // pins the documented rank order (and float accumulation for bf16).
  for (int n : {2, 3, 5, 8}) {
    INFO("N=" << n);
    const std::size_t count = 64;
    auto data = [&](int r) {
      std::mt19937 rng(static_cast<unsigned>(77 + r));
      std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
      std::uniform_int_distribution<int> exp(-10, 20);
      std::vector<float> v(count);
      for (auto& f : v) f = std::ldexp(mant(rng), exp(rng));
      return v;
    };
    std::vector<std::vector<float>> out_f(static_cast<std::size_t>(n));
    std::vector<std::vector<fsdp::bf16>> out_b(static_cast<std::size_t>(n));
    make_world(n).run([&](comm_t& c) {
      fsdp::host_queue q;
      auto f = data(c.rank());
      std::vector<fsdp::bf16> b(count);
      for (std::size_t k = 0; k < count; ++k) b[k] = __float2bfloat16(f[k]);
      c.all_reduce(f.data(), f.data(), count, dtype::f32, fsdp::reduce_op::sum, q);
      c.all_reduce(b.data(), b.data(), count, dtype::bf16, fsdp::reduce_op::sum, q).wait(c.timeout());
      out_f[static_cast<std::size_t>(c.rank())] = f;
      out_b[static_cast<std::size_t>(c.rank())] = b;
    });
    std::vector<float> ref_f(count, 0.0f), ref_b(count, 0.0f);
    for (int j = 0; j < n; ++j) {
      const auto d = data(j);
      for (std::size_t k = 0; k < count; ++k) {
        ref_f[k] += d[k];
        ref_b[k] += __bfloat162float(__float2bfloat16(d[k]));
      }
    }
    std::size_t wrong = 0;
    for (int r = 0; r < n; ++r)
      for (std::size_t k = 0; k < count; ++k) {
        wrong += std::memcmp(&out_f[static_cast<std::size_t>(r)][k], &ref_f[k], sizeof(float)) != 0;
        const fsdp::bf16 rb = __float2bfloat16(ref_b[k]);
        wrong += std::memcmp(&out_b[static_cast<std::size_t>(r)][k], &rb, sizeof(rb)) != 0;
      }
    CHECK(wrong == 0);
  }
}

TEST_CASE("broadcast from a non-zero root, N = 1..8") {
  for (int n = 1; n <= 8; ++n)
    for_each_float_type([&](auto x) {
      using T = decltype(x);
      check_broadcast<T>(n, 9, n - 1);
      check_broadcast<T>(n, 9, n / 2);
    });
  check_broadcast<float>(8, 1000, 5);
}

TEST_CASE("collectives of zero elements complete") {
  for (int n : {1, 3, 8}) {
    INFO("N=" << n);
    std::vector<int> done(static_cast<std::size_t>(n), 0);
    make_world(n).run([&](comm_t& c) {
      fsdp::host_queue q;
      std::vector<float> empty;
      c.all_gather(empty.data(), empty.data(), 0, dtype::f32, q);
      c.reduce_scatter(empty.data(), empty.data(), 0, dtype::f32, fsdp::reduce_op::avg, q);
      c.all_reduce(empty.data(), empty.data(), 0, dtype::bf16, fsdp::reduce_op::sum, q);
      c.broadcast(empty.data(), 0, dtype::f64, 0, q).wait(c.timeout());
      done[static_cast<std::size_t>(c.rank())] = 1;
    });
    CHECK(std::count(done.begin(), done.end(), 1) == n);
  }
}

TEST_CASE("many collectives in flight on two queues per rank are matched by issue order") {
  const int n = 4;
  const std::size_t count = 6;
  const int rounds = 12;
  std::vector<std::vector<std::vector<float>>> gathered(static_cast<std::size_t>(n)), reduced(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue qa("a"), qb("b");
    const int r = c.rank();
    std::vector<std::vector<float>> sends(rounds), gat(rounds), red(rounds);
    for (int i = 0; i < rounds; ++i) {
      sends[static_cast<std::size_t>(i)].resize(count);
      for (std::size_t k = 0; k < count; ++k) sends[static_cast<std::size_t>(i)][k] = static_cast<float>(input(r, k + static_cast<std::size_t>(i)));
      gat[static_cast<std::size_t>(i)].assign(count * n, -1.0f);
      red[static_cast<std::size_t>(i)].assign(count, -1.0f);
    }
    // Alternate queues; rank 2 issues with small delays so the ranks' queue threads interleave
    // differently.
    fsdp::host_event ea, eb;
    for (int i = 0; i < rounds; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      ea = c.all_gather(sends[ui].data(), gat[ui].data(), count, dtype::f32, qa);
      if (r == 2 && i % 3 == 0) std::this_thread::sleep_for(2ms);
      eb = c.all_reduce(sends[ui].data(), red[ui].data(), count, dtype::f32, fsdp::reduce_op::sum, qb);
    }
    ea.wait(c.timeout());
    eb.wait(c.timeout());
    gathered[static_cast<std::size_t>(r)] = std::move(gat);
    reduced[static_cast<std::size_t>(r)] = std::move(red);
  });
  std::size_t wrong = 0;
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < rounds; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      const auto& g = gathered[static_cast<std::size_t>(r)][ui];
      const auto& s = reduced[static_cast<std::size_t>(r)][ui];
      for (int j = 0; j < n; ++j)
        for (std::size_t k = 0; k < count; ++k)
          wrong += g[static_cast<std::size_t>(j) * count + k] != static_cast<float>(input(j, k + ui));
      for (std::size_t k = 0; k < count; ++k) {
        double sum = 0;
        for (int j = 0; j < n; ++j) sum += input(j, k + ui);
        wrong += s[k] != static_cast<float>(sum);
      }
    }
  CHECK(wrong == 0);
}

TEST_CASE("a queue that runs more than the ring's 16 collectives ahead waits for the oldest, then all complete") {
  // Collective #0 is held back on every rank's queue a until the rest have been issued on
  // queue b, and rank 0 holds it back longer: #1..#15 complete, #16..#19 meet in the slots of
  // #0..#3 (world_state.hpp, ring_size) and must wait for #0 instead of overwriting its arguments.
  const int n = 2;
  const std::size_t count = 5;
  const int later = 19;  // collectives after #0
  std::vector<std::vector<std::vector<float>>> gathered(static_cast<std::size_t>(n));
  std::atomic<int> issued{0};
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue qa("a"), qb("b");
    const int r = c.rank();
    std::vector<std::vector<float>> sends(later + 1), gat(later + 1);
    for (int i = 0; i <= later; ++i) {
      sends[static_cast<std::size_t>(i)].assign(count, static_cast<float>(100 * i + r));
      gat[static_cast<std::size_t>(i)].assign(count * n, -1.0f);
    }
    qa.enqueue([&issued, r, n] {
      while (issued.load() < n) std::this_thread::yield();
      if (r == 0) std::this_thread::sleep_for(50ms);  // #16.. arrive at #0's slot first
    });
    fsdp::host_event first = c.all_gather(sends[0].data(), gat[0].data(), count, dtype::f32, qa), last;
    for (int i = 1; i <= later; ++i)
      last = c.all_gather(sends[static_cast<std::size_t>(i)].data(), gat[static_cast<std::size_t>(i)].data(), count, dtype::f32, qb);
    ++issued;
    first.wait(c.timeout());
    last.wait(c.timeout());
    gathered[static_cast<std::size_t>(r)] = std::move(gat);
  });
  std::size_t wrong = 0;
  for (int r = 0; r < n; ++r)
    for (int i = 0; i <= later; ++i)
      for (int j = 0; j < n; ++j)
        for (std::size_t k = 0; k < count; ++k)
          wrong += gathered[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)][static_cast<std::size_t>(j) * count + k] !=
                   static_cast<float>(100 * i + j);
  CHECK(wrong == 0);
}

TEST_CASE("collectives on queue_wake::on_wait queues run on the waiting threads and match the default queue's") {
  // Issue and wait at once, as a synchronous caller does: the waiter runs the rendezvous itself.
  for (int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    const std::size_t count = 5;
    std::vector<std::vector<float>> waited(static_cast<std::size_t>(n)), queued(static_cast<std::size_t>(n));
    std::atomic<int> on_caller{0};
    make_world(n).run([&](comm_t& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      fsdp::host_queue lazy("waited", fsdp::queue_wake::on_wait), eager("queued");
      std::vector<float> send(count * static_cast<std::size_t>(n));
      for (std::size_t k = 0; k < send.size(); ++k) send[k] = static_cast<float>(input(c.rank(), k));
      for (fsdp::host_queue* q : {&lazy, &eager}) {
        auto& out = q == &lazy ? waited[r] : queued[r];
        std::vector<float> gathered(count * static_cast<std::size_t>(n) * static_cast<std::size_t>(n)), reduced(count), summed(send.size());
        c.all_gather(send.data(), gathered.data(), send.size(), dtype::f32, *q).wait(c.timeout());
        c.reduce_scatter(send.data(), reduced.data(), count, dtype::f32, fsdp::reduce_op::sum, *q).wait(c.timeout());
        c.all_reduce(send.data(), summed.data(), send.size(), dtype::f32, fsdp::reduce_op::avg, *q).wait(c.timeout());
        out = gathered;
        out.insert(out.end(), reduced.begin(), reduced.end());
        out.insert(out.end(), summed.begin(), summed.end());
      }
      const auto caller = std::this_thread::get_id();
      lazy.enqueue([&] { on_caller += std::this_thread::get_id() == caller; }, fsdp::run_on::queue_or_waiter);
      lazy.synchronize(c.timeout());
    });
    CHECK(on_caller.load() == n);
    for (int r = 0; r < n; ++r) {
      CHECK(waited[static_cast<std::size_t>(r)] == queued[static_cast<std::size_t>(r)]);
      if (n > 1)  // rank 1's first element, gathered after rank 0's count * n
        CHECK(waited[static_cast<std::size_t>(r)][count * static_cast<std::size_t>(n)] == static_cast<float>(input(1, 0)));
    }
  }
}

TEST_CASE("barrier: no rank leaves before every rank has arrived") {
  for (int n : {1, 2, 5, 8}) {
    INFO("N=" << n);
    const int rounds = 3;
    std::vector<int> arrived(static_cast<std::size_t>(n * rounds), 0);  // one cell per rank and round
    std::vector<int> seen(static_cast<std::size_t>(n * rounds), -1);    // how many arrivals each rank saw
    make_world(n).run([&](comm_t& c) {
      const int r = c.rank();
      for (int round = 0; round < rounds; ++round) {
        // Late arrivals: the last ranks sleep longest, so a barrier that does not wait is caught.
        std::this_thread::sleep_for(std::chrono::milliseconds(3 * r));
        arrived[static_cast<std::size_t>(round * n + r)] = 1;
        c.barrier();
        int count = 0;
        for (int j = 0; j < n; ++j) count += arrived[static_cast<std::size_t>(round * n + j)];
        seen[static_cast<std::size_t>(round * n + r)] = count;
      }
    });
    for (int i = 0; i < n * rounds; ++i) CHECK(seen[static_cast<std::size_t>(i)] == n);
  }
}

// ---- split ---------------------------------------------------------------------------------

namespace {

struct split_view {
  int rank = -1, size = -1, world_rank = -1;
  std::vector<std::int32_t> members;  // world ranks, gathered on the sub-communicator
  float sum = 0;                      // all_reduce of the world ranks on the sub-communicator
  std::vector<float> parent_after;    // an all_reduce on the parent after the split
};

// Splits a world of n by color_of/key_of, then runs collectives on the child and on the parent.
template <class Color, class Key>
std::vector<split_view> do_split(int n, Color color_of, Key key_of) {
  std::vector<split_view> out(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    const int wr = c.rank();
    comm_t sub = c.split(color_of(wr), key_of(wr));
    split_view v;
    v.rank = sub.rank();
    v.size = sub.size();
    v.world_rank = sub.world_rank();
    const std::int32_t me = wr;
    v.members.assign(static_cast<std::size_t>(sub.size()), -1);
    sub.all_gather(&me, v.members.data(), 1, dtype::i32, q);
    float x = static_cast<float>(wr);
    sub.all_reduce(&x, &x, 1, dtype::f32, fsdp::reduce_op::sum, q);
    // The parent still works, interleaved with the child.
    std::vector<float> p(2, 1.0f);
    c.all_reduce(p.data(), p.data(), 2, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
    v.sum = x;
    v.parent_after = p;
    out[static_cast<std::size_t>(wr)] = std::move(v);
  });
  return out;
}

}  // namespace

TEST_CASE("split: 8 ranks into 2 groups by rank % 2") {
  const auto v = do_split(8, [](int r) { return r % 2; }, [](int r) { return r; });
  for (int r = 0; r < 8; ++r) {
    INFO("world rank " << r);
    const auto& s = v[static_cast<std::size_t>(r)];
    CHECK(s.rank == r / 2);
    CHECK(s.size == 4);
    CHECK(s.world_rank == r);
    const std::int32_t c = r % 2;
    CHECK(s.members == std::vector<std::int32_t>{c, c + 2, c + 4, c + 6});
    CHECK(s.sum == (c == 0 ? 0.0f + 2 + 4 + 6 : 1.0f + 3 + 5 + 7));
    CHECK(s.parent_after == std::vector<float>{8.0f, 8.0f});
  }
}

TEST_CASE("split: 8 ranks into 2 groups by rank / 4, ordered by key") {
  SUBCASE("key = rank") {
    const auto v = do_split(8, [](int r) { return r / 4; }, [](int r) { return r; });
    for (int r = 0; r < 8; ++r) {
      INFO("world rank " << r);
      const auto& s = v[static_cast<std::size_t>(r)];
      const std::int32_t b = 4 * (r / 4);
      CHECK(s.rank == r % 4);
      CHECK(s.size == 4);
      CHECK(s.members == std::vector<std::int32_t>{b, b + 1, b + 2, b + 3});
      CHECK(s.sum == static_cast<float>(4 * b + 6));
    }
  }
  SUBCASE("key = -rank reverses the order") {
    const auto v = do_split(8, [](int r) { return r / 4; }, [](int r) { return -r; });
    for (int r = 0; r < 8; ++r) {
      INFO("world rank " << r);
      const auto& s = v[static_cast<std::size_t>(r)];
      const std::int32_t b = 4 * (r / 4);
      CHECK(s.rank == 3 - r % 4);
      CHECK(s.members == std::vector<std::int32_t>{b + 3, b + 2, b + 1, b});
    }
  }
  SUBCASE("equal keys keep the parent's rank order") {
    const auto v = do_split(8, [](int r) { return r / 4; }, [](int) { return 0; });
    for (int r = 0; r < 8; ++r) CHECK(v[static_cast<std::size_t>(r)].rank == r % 4);
  }
}

TEST_CASE("split: uneven groups and every N = 1..8") {
  for (int n = 1; n <= 8; ++n) {
    INFO("N=" << n);
    // Rank 0 alone, everyone else together.
    const auto v = do_split(n, [](int r) { return r == 0 ? 0 : 1; }, [](int r) { return r; });
    for (int r = 0; r < n; ++r) {
      const auto& s = v[static_cast<std::size_t>(r)];
      CHECK(s.size == (r == 0 ? 1 : n - 1));
      CHECK(s.rank == (r == 0 ? 0 : r - 1));
      float expected = 0;
      std::vector<std::int32_t> members;
      for (int j = 0; j < n; ++j)
        if ((j == 0) == (r == 0)) {
          expected += static_cast<float>(j);
          members.push_back(j);
        }
      CHECK(s.sum == expected);
      CHECK(s.members == members);
      CHECK(s.parent_after == std::vector<float>{static_cast<float>(n), static_cast<float>(n)});
    }
  }
}

TEST_CASE("split of a split, and traffic counters of the child start at zero") {
  struct view {
    int rank = -1, size = -1;
    std::vector<std::int32_t> members;
    fsdp::traffic_counters parent, child, grandchild;
  };
  std::vector<view> out(8);
  make_world(8).run([&](comm_t& c) {
    fsdp::host_queue q;
    const std::int32_t wr = c.rank();
    comm_t a = c.split(wr % 2, wr);                  // {0,2,4,6}, {1,3,5,7}
    comm_t b = a.split(a.rank() % 2, a.rank());      // {0,4}, {2,6}, {1,5}, {3,7}
    view v;
    v.rank = b.rank();
    v.size = b.size();
    v.members.assign(2, -1);
    b.all_gather(&wr, v.members.data(), 1, dtype::i32, q).wait(b.timeout());
    v.parent = c.traffic();
    v.child = a.traffic();
    v.grandchild = b.traffic();
    out[static_cast<std::size_t>(wr)] = std::move(v);
  });
  for (int r = 0; r < 8; ++r) {
    INFO("world rank " << r);
    const auto& v = out[static_cast<std::size_t>(r)];
    const std::int32_t lo = r % 4;  // partners differ by 4
    CHECK(v.size == 2);
    CHECK(v.rank == r / 4);
    CHECK(v.members == std::vector<std::int32_t>{lo, lo + 4});
    CHECK(v.parent == fsdp::traffic_counters{});
    CHECK(v.child == fsdp::traffic_counters{});
    CHECK(v.grandchild.all_gather == 4u * 1u);  // one i32 to one peer
    CHECK(v.grandchild.collectives == 1u);
  }
}

TEST_CASE("split rejects a negative color") {
  std::vector<int> codes(1, -1);
  make_world(1).run([&](comm_t& c) {
    try {
      (void)c.split(-1, 0);
    } catch (const fsdp::error& e) {
      codes[0] = static_cast<int>(e.code());
    }
  });
  CHECK(codes[0] == static_cast<int>(fsdp::errc::invalid_argument));
}

// ---- traffic counters ----------------------------------------------------------------------

TEST_CASE("traffic counters follow the ring formulas, N = 1..8") {
  for (int n = 1; n <= 8; ++n) {
    INFO("N=" << n);
    const std::uint64_t un = static_cast<std::uint64_t>(n);
    std::vector<std::vector<fsdp::traffic_counters>> steps(static_cast<std::size_t>(n));
    const std::size_t c_ag = 10, c_rs = 12, c_ar = 24, c_bc = 48, c_bf = 6;
    make_world(n).run([&](comm_t& c) {
      fsdp::host_queue q;
      std::vector<float> big(static_cast<std::size_t>(n) * 64, 1.0f), out(static_cast<std::size_t>(n) * 64);
      std::vector<fsdp::bf16> hb(static_cast<std::size_t>(n) * 64);
      std::vector<fsdp::traffic_counters> s;
      s.push_back(c.traffic());
      c.all_gather(big.data(), out.data(), c_ag, dtype::f32, q);
      s.push_back(c.traffic());
      c.reduce_scatter(big.data(), out.data(), c_rs, dtype::f32, fsdp::reduce_op::sum, q);
      s.push_back(c.traffic());
      c.all_reduce(big.data(), out.data(), c_ar, dtype::f32, fsdp::reduce_op::avg, q);
      s.push_back(c.traffic());
      c.broadcast(out.data(), c_bc, dtype::f32, 0, q);
      s.push_back(c.traffic());
      // In place: each rank's send is its own chunk of recv.
      c.all_gather(hb.data() + static_cast<std::size_t>(c.rank()) * c_bf, hb.data(), c_bf, dtype::bf16, q)
          .wait(c.timeout());
      s.push_back(c.traffic());
      c.barrier();  // not a data collective
      s.push_back(c.traffic());
      steps[static_cast<std::size_t>(c.rank())] = std::move(s);
    });
    // Expected, per the ring algorithms: m(n-1)/n with m the full size, 2m(n-1)/n for all_reduce.
    const std::uint64_t ag = c_ag * 4 * (un - 1);
    const std::uint64_t rs = c_rs * 4 * (un - 1);
    const std::uint64_t ar = 2 * c_ar * 4 * (un - 1) / un;
    const std::uint64_t bc = c_bc * 4 * (un - 1) / un;
    const std::uint64_t ag_bf = c_bf * 2 * (un - 1);
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r);
      const auto& s = steps[static_cast<std::size_t>(r)];
      REQUIRE(s.size() == 7);
      CHECK(s[0] == fsdp::traffic_counters{});
      CHECK(s[1].all_gather == ag);
      CHECK(s[1].collectives == 1);
      CHECK((s[2] - s[1]).reduce_scatter == rs);
      CHECK((s[2] - s[1]).all_gather == 0);
      CHECK((s[3] - s[2]).all_reduce == ar);
      CHECK((s[4] - s[3]).broadcast == bc);
      CHECK((s[5] - s[4]).all_gather == ag_bf);
      CHECK(s[5].collectives == 5);
      CHECK(s[6] == s[5]);
      CHECK(s[5].total() == ag + rs + ar + bc + ag_bf);
      CHECK(s[5].all_gather == ag + ag_bf);
    }
  }
}

TEST_CASE("traffic_counters arithmetic") {
  const fsdp::traffic_counters a{1, 2, 3, 4, 5}, b{10, 20, 30, 40, 50};
  const auto s = a + b;
  CHECK(s == fsdp::traffic_counters{11, 22, 33, 44, 55});
  CHECK(s - a == b);
  CHECK(s.total() == 11 + 22 + 33 + 44);  // collectives are a count, not bytes
  CHECK_FALSE(a == b);
}

// ---- failures ------------------------------------------------------------------------------

TEST_CASE("mismatched collectives fail with errc::mismatch naming both sides") {
  SUBCASE("different counts") {
    const auto o = run_world(2, short_timeout, [](comm_t& c) {
      fsdp::host_queue q;
      const std::size_t count = c.rank() == 0 ? 4 : 5;
      std::vector<float> send(count, 1.0f), recv(2 * count);
      c.all_gather(send.data(), recv.data(), count, dtype::f32, q).wait(c.timeout());
    });
    CHECK(o.ms < hang_bound_ms);
    const auto e = as_fsdp_error(o.error);
    CHECK(e.code() == fsdp::errc::mismatch);
    const std::string w = e.what();
    INFO(w);
    CHECK(contains(w, "all_gather of 4 f32"));
    CHECK(contains(w, "all_gather of 5 f32"));
    CHECK(contains(w, "rank 0"));
    CHECK(contains(w, "rank 1"));
  }
  SUBCASE("different kinds, dtypes, ops and roots, one odd rank of four") {
    struct variant {
      const char* name;
      const char* expect_odd;
    };
    for (const variant v : {variant{"kind", "all_reduce"}, variant{"dtype", "bf16"},
                            variant{"op", "(avg)"}, variant{"root", "root 2"},
                            variant{"barrier", "barrier"}}) {
      const std::string name = v.name;
      INFO(name);
      const auto o = run_world(4, short_timeout, [&](comm_t& c) {
        fsdp::host_queue q;
        const bool odd = c.rank() == 3;
        std::vector<float> a(64, 1.0f), b(64, 0.0f);
        if (name == "kind") {
          if (odd) c.all_reduce(a.data(), b.data(), 4, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
          else c.all_gather(a.data(), b.data(), 4, dtype::f32, q).wait(c.timeout());
        } else if (name == "dtype") {
          c.all_reduce(a.data(), b.data(), 4, odd ? dtype::bf16 : dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
        } else if (name == "op") {
          c.all_reduce(a.data(), b.data(), 4, dtype::f32, odd ? fsdp::reduce_op::avg : fsdp::reduce_op::sum, q)
              .wait(c.timeout());
        } else if (name == "root") {
          c.broadcast(a.data(), 4, dtype::f32, odd ? 2 : 1, q).wait(c.timeout());
        } else {
          if (odd) c.barrier();
          else c.all_reduce(a.data(), b.data(), 4, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
        }
      });
      CHECK(o.ms < hang_bound_ms);
      const auto e = as_fsdp_error(o.error);
      CHECK(e.code() == fsdp::errc::mismatch);
      const std::string w = e.what();
      INFO(w);
      CHECK(contains(w, v.expect_odd));
      CHECK(contains(w, "rank 3"));
      CHECK(contains(w, "rank 0"));
    }
  }
}

TEST_CASE("a rank that returns without joining: the others fail with peer_failure, quickly") {
  // The timeout is long: detection must come from the rank leaving, not from the clock.
  const milliseconds long_timeout = 20000ms;
  SUBCASE("never issues anything") {
    std::vector<int> codes(3, -1);
    const auto o = run_world(3, long_timeout, [&](comm_t& c) {
      if (c.rank() == 2) return;
      fsdp::host_queue q;
      std::vector<float> s(4, 1.0f), r(12);
      try {
        c.all_gather(s.data(), r.data(), 4, dtype::f32, q).wait(c.timeout());
      } catch (const fsdp::error& e) {
        codes[static_cast<std::size_t>(c.rank())] = static_cast<int>(e.code());
        throw;
      }
    });
    CHECK(o.ms < hang_bound_ms);
    const auto e = as_fsdp_error(o.error);
    CHECK(e.code() == fsdp::errc::peer_failure);
    INFO(std::string(e.what()));
    // Names the rank that left, and only it (ranks 0 and 1 may simply not have arrived yet).
    CHECK(contains(e.what(), "rank(s) 2 returned without joining"));
    CHECK(codes[0] == static_cast<int>(fsdp::errc::peer_failure));
    CHECK(codes[1] == static_cast<int>(fsdp::errc::peer_failure));
  }
  SUBCASE("leaves after the first of two collectives") {
    std::vector<int> first_ok(4, 0);
    const auto o = run_world(4, long_timeout, [&](comm_t& c) {
      fsdp::host_queue q;
      std::vector<float> x(3, 1.0f);
      c.all_reduce(x.data(), x.data(), 3, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
      first_ok[static_cast<std::size_t>(c.rank())] = x[0] == 4.0f;
      if (c.rank() == 1) return;
      c.all_reduce(x.data(), x.data(), 3, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
    });
    CHECK(o.ms < hang_bound_ms);
    CHECK(first_ok == std::vector<int>{1, 1, 1, 1});
    const auto e = as_fsdp_error(o.error);
    CHECK(e.code() == fsdp::errc::peer_failure);
  }
  SUBCASE("leaves before a barrier") {
    const auto o = run_world(3, long_timeout, [&](comm_t& c) {
      if (c.rank() == 0) return;
      c.barrier();
    });
    CHECK(o.ms < hang_bound_ms);
    CHECK(as_fsdp_error(o.error).code() == fsdp::errc::peer_failure);
  }
}

TEST_CASE("a stuck rank: world::run rethrows errc::timeout, the root cause") {
  for (int n : {2, 4}) {
    INFO("N=" << n);
    const int stuck = n - 1;
    std::vector<int> late_code(1, -1);
    const auto o = run_world(n, short_timeout, [&](comm_t& c) {
      fsdp::host_queue q;
      std::vector<float> s(4, 1.0f), r(4 * static_cast<std::size_t>(n));
      if (c.rank() == stuck) {
        std::this_thread::sleep_for(short_timeout * 3);
        try {
          c.all_gather(s.data(), r.data(), 4, dtype::f32, q).wait(c.timeout());
        } catch (const fsdp::error& e) {
          late_code[0] = static_cast<int>(e.code());  // the world has given up by now
          throw;
        }
        return;
      }
      c.all_gather(s.data(), r.data(), 4, dtype::f32, q).wait(c.timeout());
    });
    CHECK(o.ms < hang_bound_ms);
    CHECK(o.ms >= static_cast<double>(short_timeout.count()) * 0.9);
    const auto e = as_fsdp_error(o.error);
    CHECK(e.code() == fsdp::errc::timeout);  // not the peer_failure the stuck rank echoes
    INFO(std::string(e.what()));
    CHECK(contains(e.what(), "rank(s) " + std::to_string(stuck)));
    CHECK(late_code[0] == static_cast<int>(fsdp::errc::peer_failure));
  }
}

TEST_CASE("a stuck rank before a barrier times out too") {
  const auto o = run_world(3, short_timeout, [&](comm_t& c) {
    if (c.rank() == 1) std::this_thread::sleep_for(short_timeout * 3);
    c.barrier();
  });
  CHECK(o.ms < hang_bound_ms);
  CHECK(as_fsdp_error(o.error).code() == fsdp::errc::timeout);
}

TEST_CASE("a rank that throws: world::run rethrows that exception, not an fsdp::error") {
  SUBCASE("before any collective") {
    const auto o = run_world(4, 20000ms, [&](comm_t& c) {
      if (c.rank() == 2) throw std::runtime_error("rank 2 exploded");
      fsdp::host_queue q;
      std::vector<float> x(8, 1.0f);
      c.all_reduce(x.data(), x.data(), 8, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
    });
    CHECK(o.ms < hang_bound_ms);
    REQUIRE(o.error);
    CHECK_THROWS_WITH_AS(std::rethrow_exception(o.error), "rank 2 exploded", std::runtime_error);
    bool is_fsdp_error = false;
    try {
      std::rethrow_exception(o.error);
    } catch (const fsdp::error&) {
      is_fsdp_error = true;
    } catch (...) {
    }
    CHECK_FALSE(is_fsdp_error);  // the rank's own exception, not a wrapped one
  }
  SUBCASE("between collectives, while the others wait") {
    std::vector<int> codes(3, -1);
    const auto o = run_world(3, 20000ms, [&](comm_t& c) {
      fsdp::host_queue q;
      std::vector<float> x(8, 1.0f);
      c.all_reduce(x.data(), x.data(), 8, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
      if (c.rank() == 0) {
        std::this_thread::sleep_for(50ms);  // the others are waiting in the second collective
        throw std::logic_error("rank 0 bug");
      }
      try {
        c.all_reduce(x.data(), x.data(), 8, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
      } catch (const fsdp::error& e) {
        codes[static_cast<std::size_t>(c.rank())] = static_cast<int>(e.code());
        throw;
      }
    });
    CHECK(o.ms < hang_bound_ms);
    CHECK_THROWS_WITH_AS(std::rethrow_exception(o.error), "rank 0 bug", std::logic_error);
    CHECK(codes[1] == static_cast<int>(fsdp::errc::peer_failure));
    CHECK(codes[2] == static_cast<int>(fsdp::errc::peer_failure));
  }
}

TEST_CASE("communicator::abort ends the other ranks' waits with peer_failure") {
  SUBCASE("abort alone: run rethrows the peers' peer_failure") {
    std::string seen;
    const auto o = run_world(2, 20000ms, [&](comm_t& c) {
      if (c.rank() == 0) {
        c.abort("rank 0 gives up");
        return;
      }
      std::this_thread::sleep_for(20ms);
      fsdp::host_queue q;
      std::vector<float> x(2, 1.0f);
      try {
        c.all_reduce(x.data(), x.data(), 2, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
      } catch (const fsdp::error& e) {
        seen = e.what();
        throw;
      }
    });
    CHECK(o.ms < hang_bound_ms);
    const auto e = as_fsdp_error(o.error);
    CHECK(e.code() == fsdp::errc::peer_failure);
    CHECK(contains(seen, "rank 0 gives up"));
  }
  SUBCASE("abort while unwinding: the peers' echo does not hide the root cause") {
    // The documented use: a rank about to throw aborts first so peers stop waiting on it. Its
    // peers fail (and report peer_failure) before its own exception reaches world::run.
    std::vector<int> codes(3, -1);
    const auto o = run_world(3, 20000ms, [&](comm_t& c) {
      fsdp::host_queue q;
      std::vector<float> x(2, 1.0f);
      if (c.rank() == 0) {
        c.abort("rank 0 is unwinding");
        std::this_thread::sleep_for(100ms);
        throw std::runtime_error("the real cause");
      }
      try {
        c.all_reduce(x.data(), x.data(), 2, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
      } catch (const fsdp::error& e) {
        codes[static_cast<std::size_t>(c.rank())] = static_cast<int>(e.code());
        throw;
      }
    });
    CHECK(o.ms < hang_bound_ms);
    CHECK(codes[1] == static_cast<int>(fsdp::errc::peer_failure));
    CHECK(codes[2] == static_cast<int>(fsdp::errc::peer_failure));
    CHECK_THROWS_WITH_AS(std::rethrow_exception(o.error), "the real cause", std::runtime_error);
  }
}

TEST_CASE("a rank that gives up before its peers arrive withdraws: a late peer fails, it does not read") {
  // Rank 0 aborts while its all-gather waits for rank 1, then frees its send buffer, as a caller
  // unwinding does. Rank 1's all-gather was issued before the abort but arrives later (its queue
  // is busy): it must fail, not find every member "arrived" and copy from the freed buffer.
  constexpr std::size_t count = std::size_t{1} << 20;
  std::vector<int> codes(2, -1);
  const auto o = run_world(2, generous, [&](comm_t& c) {
    mapped_floats send(count), recv(2 * count);
    fsdp::host_queue q;
    if (c.rank() == 1) q.enqueue([] { std::this_thread::sleep_for(200ms); });
    auto done = c.all_gather(send.data(), recv.data(), count, dtype::f32, q);
    c.barrier();  // both have issued it
    if (c.rank() == 0) c.abort("rank 0 gives up");
    try {
      done.wait(c.timeout());
    } catch (const fsdp::error& e) {
      codes[static_cast<std::size_t>(c.rank())] = static_cast<int>(e.code());
    }
    send.release();
  });
  CHECK(o.ms < hang_bound_ms);
  CHECK_FALSE(o.error);  // both ranks caught their failure
  CHECK(codes[0] == static_cast<int>(fsdp::errc::peer_failure));
  CHECK(codes[1] == static_cast<int>(fsdp::errc::peer_failure));
}

TEST_CASE("a world that aborts while a reduction's data moves: no rank leaves while a peer reads its buffer") {
  // Rank 0 aborts at a varying point of a large reduce-scatter, and each rank frees its send
  // buffer as soon as its event completes. Once every member has arrived, each reads the others'
  // send buffers, so the data phase must end on every rank before any leaves; before issue 10's
  // fix a rank left at the abort and its buffer was unmapped under a reading peer (SIGSEGV).
  // A reduction that completes holds the right sums.
  constexpr std::size_t count = std::size_t{2} << 20;  // per rank; each send buffer is 2 x count
  for (int delay_ms = 0; delay_ms < 16; ++delay_ms) {
    CAPTURE(delay_ms);
    std::vector<int> ok(2, 0), right(2, 0);
    const auto o = run_world(2, generous, [&](comm_t& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      mapped_floats send(2 * count), recv(count);
      std::fill(send.data(), send.data() + 2 * count, static_cast<float>(r + 1));
      fsdp::host_queue q;
      c.barrier();
      try {
        auto done = c.reduce_scatter(send.data(), recv.data(), count, dtype::f32, fsdp::reduce_op::sum, q);
        if (r == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
          c.abort("rank 0 gives up mid-reduction");
        }
        done.wait(c.timeout());
        ok[r] = 1;
        right[r] = std::all_of(recv.data(), recv.data() + count, [](float x) { return x == 3.0f; });
      } catch (const fsdp::error&) {
      }
      send.release();
    });
    CHECK(o.ms < hang_bound_ms);
    CHECK_FALSE(o.error);  // each rank caught its failure, if it had one
    CHECK(ok[0] == right[0]);
    CHECK(ok[1] == right[1]);
  }
}

TEST_CASE("reducing a non-reducible dtype throws errc::unsupported_dtype and issues nothing") {
  const int n = 2;
  std::vector<std::vector<int>> codes(static_cast<std::size_t>(n));
  std::vector<std::string> messages(static_cast<std::size_t>(n));
  std::vector<float> after(static_cast<std::size_t>(n), 0);
  std::vector<fsdp::traffic_counters> traffic(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    std::vector<std::int64_t> buf(8, 1);
    auto record = [&](auto&& f) {
      try {
        f();
        codes[static_cast<std::size_t>(c.rank())].push_back(-1);
      } catch (const fsdp::error& e) {
        codes[static_cast<std::size_t>(c.rank())].push_back(static_cast<int>(e.code()));
        messages[static_cast<std::size_t>(c.rank())] = e.what();
      }
    };
    record([&] { c.reduce_scatter(buf.data(), buf.data(), 2, dtype::i64, fsdp::reduce_op::sum, q); });
    record([&] { c.all_reduce(buf.data(), buf.data(), 4, dtype::u8, fsdp::reduce_op::avg, q); });
    record([&] { c.all_reduce(buf.data(), buf.data(), 4, dtype::i32, fsdp::reduce_op::sum, q); });
    traffic[static_cast<std::size_t>(c.rank())] = c.traffic();
    // Nothing was issued: the next collective still matches across ranks.
    float x = 2.0f;
    c.all_reduce(&x, &x, 1, dtype::f32, fsdp::reduce_op::sum, q).wait(c.timeout());
    after[static_cast<std::size_t>(c.rank())] = x;
  });
  const int u = static_cast<int>(fsdp::errc::unsupported_dtype);
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    CHECK(codes[static_cast<std::size_t>(r)] == std::vector<int>{u, u, u});
    CHECK(contains(messages[static_cast<std::size_t>(r)], "i32"));
    CHECK(traffic[static_cast<std::size_t>(r)] == fsdp::traffic_counters{});
    CHECK(after[static_cast<std::size_t>(r)] == 4.0f);
  }
}

TEST_CASE("broadcast with a root outside the group throws invalid_argument") {
  const int n = 3;
  std::vector<std::vector<int>> codes(static_cast<std::size_t>(n));
  std::vector<std::vector<float>> after(static_cast<std::size_t>(n));
  make_world(n).run([&](comm_t& c) {
    fsdp::host_queue q;
    std::vector<float> buf(4, static_cast<float>(c.rank()));
    for (int root : {-1, n, 100}) {
      try {
        c.broadcast(buf.data(), 4, dtype::f32, root, q);
        codes[static_cast<std::size_t>(c.rank())].push_back(-1);
      } catch (const fsdp::error& e) {
        codes[static_cast<std::size_t>(c.rank())].push_back(static_cast<int>(e.code()));
      }
    }
    c.broadcast(buf.data(), 4, dtype::f32, 1, q).wait(c.timeout());  // still in step
    after[static_cast<std::size_t>(c.rank())] = buf;
  });
  const int ia = static_cast<int>(fsdp::errc::invalid_argument);
  for (int r = 0; r < n; ++r) {
    CHECK(codes[static_cast<std::size_t>(r)] == std::vector<int>{ia, ia, ia});
    CHECK(after[static_cast<std::size_t>(r)] == std::vector<float>(4, 1.0f));
  }
}

TEST_CASE("world rejects bad sizes and timeouts") {
  for (int n : {0, -1}) {
    INFO("N=" << n);
    try {
      const fsdp::threads::world w{n};
      (void)w;
      FAIL("world{" << n << "} did not throw");
    } catch (const fsdp::error& e) {
      CHECK(e.code() == fsdp::errc::invalid_argument);
    }
  }
  try {
    const fsdp::threads::world w{2, {.timeout = 0ms}};
    (void)w;
    FAIL("a zero timeout did not throw");
  } catch (const fsdp::error& e) {
    CHECK(e.code() == fsdp::errc::invalid_argument);
  }
  CHECK(fsdp::threads::world{1}.size() == 1);
  CHECK(fsdp::threads::world{7}.size() == 7);
}

TEST_CASE("world: ranks see their rank, size and timeout, and a world can run twice") {
  const fsdp::threads::world w{5, {.timeout = 1234ms}};
  for (int pass = 0; pass < 2; ++pass) {
    std::vector<int> ranks(5, -1), sizes(5, -1);
    std::vector<long long> timeouts(5, -1);
    w.run([&](comm_t& c) {
      ranks[static_cast<std::size_t>(c.rank())] = c.world_rank();
      sizes[static_cast<std::size_t>(c.rank())] = c.size();
      timeouts[static_cast<std::size_t>(c.rank())] = c.timeout().count();
      c.barrier();
    });
    CHECK(ranks == std::vector<int>{0, 1, 2, 3, 4});
    CHECK(sizes == std::vector<int>(5, 5));
    CHECK(timeouts == std::vector<long long>(5, 1234));
  }
}

TEST_CASE("default_timeout reads FSDP_TIMEOUT_MS") {
  // No other thread runs here, so changing the environment is safe.
  const char* old = std::getenv("FSDP_TIMEOUT_MS");
  const std::string saved = old ? old : "";
  ::setenv("FSDP_TIMEOUT_MS", "1234", 1);
  CHECK(fsdp::default_timeout() == 1234ms);
  CHECK(fsdp::threads::world_options{}.timeout == 1234ms);
  for (const char* bad : {"", "abc", "-5", "0", "12x"}) {
    INFO("FSDP_TIMEOUT_MS='" << bad << "'");
    ::setenv("FSDP_TIMEOUT_MS", bad, 1);
    CHECK(fsdp::default_timeout() == 300000ms);
  }
  ::unsetenv("FSDP_TIMEOUT_MS");
  CHECK(fsdp::default_timeout() == 300000ms);
  if (old) ::setenv("FSDP_TIMEOUT_MS", saved.c_str(), 1);
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)  // sanitizers need the address space
TEST_CASE("a world whose threads cannot all start: errc::invalid_argument naming the rank, no terminate") {
  // An address-space limit just above what the process uses: each thread's 8 MiB stack is an
  // mmap, so a world of 64 ranks runs out after a few. world::run used to leave the started
  // threads joinable and die in std::terminate (exit 134).
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  statm >> pages;
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_AS, &old) == 0);
  rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) + (rlim_t{96} << 20);
  std::optional<fsdp::error> caught;
  std::atomic<int> started{0};
  REQUIRE(setrlimit(RLIMIT_AS, &low) == 0);
  try {
    fsdp::threads::world{64, {.timeout = std::chrono::milliseconds(20000)}}.run([&](comm_t& c) {
      ++started;
      c.barrier();  // waits for ranks that never start: must end at once, not at the timeout
    });
  } catch (const fsdp::error& e) {
    caught = e;
  }
  setrlimit(RLIMIT_AS, &old);
  REQUIRE(caught.has_value());
  CHECK(caught->code() == fsdp::errc::invalid_argument);
  CHECK_MESSAGE(std::string(caught->what()).find("a world of 64 ranks: could not start the thread of rank") != std::string::npos,
                caught->what());
  CHECK(started.load() < 64);
}
#endif

TEST_CASE("topology: hosts of a world and of its splits, ranks per host, remote peers") {
  CHECK(fsdp::topology{{0, 0, 1, 1}}.ranks_per_host() == 2);
  CHECK(fsdp::topology{{0, 0, 0}}.ranks_per_host() == 3);
  CHECK(fsdp::topology{{0, 1, 0, 1}}.ranks_per_host() == 0);  // interleaved
  CHECK(fsdp::topology{{0, 0, 0, 1}}.ranks_per_host() == 0);  // uneven
  CHECK(fsdp::topology{{0, 0, 0, 1}}.remote_peers(3) == 3);
  CHECK(fsdp::topology{{0, 0, 0, 1}}.remote_peers(1) == 1);
  CHECK(fsdp::topology{{0, 1, 0, 1}}.str() == "2 hosts: [0 1 0 1]");

  std::vector<std::vector<int>> world(4), across(4), inside(4);
  std::vector<fsdp::traffic_counters> sent(4);
  fsdp::threads::world{4, {.ranks_per_host = 2}}.run([&](fsdp::threads::communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto as_vector = [](std::span<const int> h) { return std::vector<int>(h.begin(), h.end()); };
    world[r] = as_vector(comm.hosts());
    auto a = comm.split(comm.rank() % 2, comm.rank());  // {0, 2}, {1, 3}: one rank per host
    auto b = comm.split(comm.rank() / 2, comm.rank());  // {0, 1}, {2, 3}: one host each
    across[r] = as_vector(a.hosts());
    inside[r] = as_vector(b.hosts());
    fsdp::host_queue q;
    std::vector<float> in(8, 1.0f), out(32);
    comm.all_gather(in.data(), out.data(), 8, fsdp::dtype::f32, q).wait(comm.timeout(), "all_gather");
    a.all_gather(in.data(), out.data(), 8, fsdp::dtype::f32, q).wait(comm.timeout(), "all_gather");
    b.all_gather(in.data(), out.data(), 8, fsdp::dtype::f32, q).wait(comm.timeout(), "all_gather");
    sent[r] = comm.traffic() + a.traffic() + b.traffic();
  });
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(world[r] == std::vector<int>{0, 0, 1, 1});
    CHECK(across[r] == std::vector<int>{0, 1});
    CHECK(inside[r] == std::vector<int>{0, 0});
    // 32 bytes to each peer: the world's 2 remote peers, the split across hosts' one.
    CHECK(sent[r].total() == 32 * 3 + 32 + 32);
    CHECK(sent[r].inter_host == 32 * 2 + 32);
  }
}

TEST_CASE("a world of bad size, timeout or ranks per host throws invalid_argument naming it, before any thread starts") {
  using fsdp_test::check_error;
  constexpr fsdp::errc invalid = fsdp::errc::invalid_argument;
  check_error([] { fsdp::threads::world{0}; }, invalid, "a world needs at least 1 rank, got 0");
  check_error([] { fsdp::threads::world(2, {.timeout = std::chrono::milliseconds(0)}); }, invalid, "world timeout must be positive");
  check_error([] { fsdp::threads::world(2, {.ranks_per_host = -1}); }, invalid, "ranks_per_host must be >= 0 (0: one host), got -1");
}
