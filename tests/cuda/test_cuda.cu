// Tests of the CUDA device (device/cuda.hpp) and the NCCL backend (comm/nccl.hpp), compiled by
// nvcc. Without a usable GPU (the build machines) only the first cases run: they check the
// clear no-device failure. With a GPU, the rest check the device vocabulary, a one-rank NCCL
// communicator (every collective, host staging, groups, split, barrier, abort) and shard_group
// on it against the values a one-rank run must give.

#include "fsdp/comm/nccl.hpp"
#include "fsdp/device/cuda.hpp"
#include "fsdp/fsdp.hpp"

#include <doctest/doctest.h>

#include "common/catch_error.hpp"
#include "common/gpu.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <thrust/fill.h>
#include <thrust/sequence.h>
#include <thrust/transform.h>

namespace {

using namespace std::chrono_literals;

using fsdp_test::contains;
using fsdp_test::has_gpu;

// A one-rank communicator on device 0.
fsdp::nccl::communicator one_rank(const fsdp::cuda_device& gpu) {
  return fsdp::nccl::communicator(gpu, 0, 1, fsdp::nccl::make_unique_id(), 30'000ms);
}

struct twice {
  __host__ __device__ float operator()(float x) const { return 2 * x; }
};

std::vector<float> to_host(const fsdp::cuda_device& gpu, const void* p, std::size_t n) {
  std::vector<float> v(n);
  gpu.copy_to_host(v.data(), p, n * sizeof(float));
  return v;
}

}  // namespace

TEST_CASE("cuda_device: without a usable GPU, construction fails with errc::no_device" * doctest::skip(has_gpu)) {
  for (int ordinal : {-1, 0, 3}) {
    CAPTURE(ordinal);
    const fsdp::error e = fsdp_test::catch_error([&] { fsdp::cuda_device gpu = ordinal < 0 ? fsdp::cuda_device{} : fsdp::cuda_device{ordinal}; });
    CHECK(e.code() == fsdp::errc::no_device);
    CHECK(contains(e.what(), "no CUDA device: "));
  }
  const fsdp::error q = fsdp_test::catch_error([] { fsdp::cuda_queue queue{"all_gather"}; });
  CHECK(q.code() == fsdp::errc::no_device);
  CHECK(contains(q.what(), "'all_gather'"));
}

TEST_CASE("cuda_graph: without a usable GPU, capture fails with errc::no_device" * doctest::skip(has_gpu)) {
  bool issued = false;
  const fsdp::error e = fsdp_test::catch_error([&] { fsdp::cuda_graph::capture(nullptr, [&] { issued = true; }); });
  CHECK(e.code() == fsdp::errc::no_device);
  CHECK(contains(e.what(), "cudaStreamBeginCapture"));
  CHECK(!issued);
}

TEST_CASE("cuda_graph: a captured fill and sequence run again at every launch" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  fsdp::cuda_queue side{"side"};
  auto buf = gpu.allocate(1 << 16, fsdp::mem_kind::persistent);
  const std::size_t n = (1 << 16) / sizeof(float);
  cudaStream_t s = gpu.compute_stream();
  // The side queue joins the capture through the event it waits on, as fsdp's queues do.
  auto graph = fsdp::cuda_graph::capture(s, [&] {
    fsdp::cuda_event start = fsdp::cuda_event::create();
    start.record_on(s);
    side.wait(start, 10s);
    side.launch([p = buf.as<float>(), n](auto policy) { thrust::sequence(policy, p, p + n); });
    gpu.compute_wait(side.record(), 10s);
  });
  CHECK(graph.nodes() >= 1);
  for (int k = 0; k < 2; ++k) {
    gpu.zero(buf.data(), buf.bytes());
    graph.launch(s);
    const auto host = to_host(gpu, buf.data(), n);
    CHECK(host[n - 1] == static_cast<float>(n - 1));
  }
}

TEST_CASE("cuda_graph: buffers allocated inside a capture are the graph's; one left unfreed, one for a stream outside the "
          "capture and a host wait are refused by name" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  fsdp::cuda_queue side{"side"};
  const std::size_t n = 4096;
  auto out = gpu.allocate(n * sizeof(float), fsdp::mem_kind::persistent);
  const std::size_t live = gpu.memory().live;
  // A step's pattern: a buffer made for a queue (a collective's output), written there, read by
  // compute, freed on compute.
  auto graph = fsdp::cuda_graph::capture(gpu, [&] {
    side.wait(gpu.compute_record(), 10s);
    auto tmp = gpu.allocate_uninitialized(n * sizeof(float), fsdp::mem_kind::transient, side);
    side.launch([p = tmp.as<float>(), n](auto policy) { thrust::sequence(policy, p, p + n); });
    gpu.compute_wait(side.record(), 10s);
    thrust::transform(gpu.execution_policy(), tmp.as<float>(), tmp.as<float>() + n, out.as<float>(), twice{});
  });
  CHECK(graph.nodes() >= 4);  // allocation, sequence, transform, free
  CHECK(gpu.memory().live == live);
  CHECK(gpu.graph_allocations() == 0);
  for (int k = 0; k < 3; ++k) {
    gpu.zero(out.data(), out.bytes());
    graph.launch(gpu.compute_stream());
    const auto host = to_host(gpu, out.data(), n);
    CHECK(host[n - 1] == 2.0f * static_cast<float>(n - 1));
  }

  fsdp::cuda_buffer kept;
  const fsdp::error unfreed = fsdp_test::catch_error([&] {
    fsdp::cuda_graph::capture(gpu, [&] { kept = gpu.allocate_uninitialized(1024, fsdp::mem_kind::transient); });
  });
  CHECK(unfreed.code() == fsdp::errc::invalid_argument);
  CHECK(contains(unfreed.what(), "left 1 buffer(s)"));

  fsdp::cuda_queue outside{"outside"};
  const fsdp::error elsewhere = fsdp_test::catch_error([&] {
    fsdp::cuda_graph::capture(gpu, [&] { auto b = gpu.allocate_uninitialized(1024, fsdp::mem_kind::transient, outside); });
  });
  CHECK(elsewhere.code() == fsdp::errc::invalid_argument);
  CHECK(contains(elsewhere.what(), "for a stream outside the capture"));

  const fsdp::error wait = fsdp_test::catch_error([&] { fsdp::cuda_graph::capture(gpu, [&] { gpu.compute_record().wait(1s, "a step's event"); }); });
  CHECK(wait.code() == fsdp::errc::invalid_argument);
  CHECK(contains(wait.what(), "waiting for a step's event inside a CUDA graph capture"));
}

TEST_CASE("device_resident: nullptr needs no staging, pageable host memory does (also without a GPU)") {
  std::vector<float> pageable(16);
  CHECK(fsdp::detail::device_resident(nullptr));
  CHECK_FALSE(fsdp::detail::device_resident(pageable.data()));
}

TEST_CASE("device_resident: device and managed memory are used in place; pinned host memory is staged" * doctest::skip(!has_gpu)) {
  void *device = nullptr, *managed = nullptr, *pinned = nullptr;
  REQUIRE(cudaMalloc(&device, 64) == cudaSuccess);
  REQUIRE(cudaMallocManaged(&managed, 64) == cudaSuccess);
  REQUIRE(cudaMallocHost(&pinned, 64) == cudaSuccess);
  CHECK(fsdp::detail::device_resident(device));
  CHECK(fsdp::detail::device_resident(static_cast<char*>(device) + 8));
  CHECK(fsdp::detail::device_resident(managed));
  CHECK_FALSE(fsdp::detail::device_resident(pinned));
  cudaFree(device);
  cudaFree(managed);
  cudaFreeHost(pinned);
}

TEST_CASE("nccl: a unique id needs no GPU") {
  const fsdp::nccl::unique_id a = fsdp::nccl::make_unique_id();
  const fsdp::nccl::unique_id b = fsdp::nccl::make_unique_id();
  CHECK(std::memcmp(&a, &b, sizeof(a)) != 0);
}

TEST_CASE("cuda_device: allocate, copy, zero and memory accounting" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  const fsdp::cuda_device copy = gpu;  // shares the counters
  {
    auto a = gpu.allocate(1000 * sizeof(float), fsdp::mem_kind::persistent);
    auto b = copy.allocate(500 * sizeof(float), fsdp::mem_kind::transient);
    CHECK(gpu.memory().live == 1500 * sizeof(float));
    CHECK(gpu.memory().persistent_live == 1000 * sizeof(float));
    CHECK(to_host(gpu, a.data(), 1000) == std::vector<float>(1000, 0.0f));  // zero-filled
    std::vector<float> v(1000);
    std::iota(v.begin(), v.end(), 1.0f);
    gpu.copy_from_host(a.data(), v.data(), v.size() * sizeof(float));
    gpu.copy(b.data(), a.data(), 500 * sizeof(float));
    CHECK(to_host(gpu, b.data(), 500) == std::vector<float>(v.begin(), v.begin() + 500));
    gpu.zero(a.data(), a.bytes());
    CHECK(to_host(gpu, a.data(), 1000) == std::vector<float>(1000, 0.0f));
  }
  CHECK(gpu.memory().live == 0);
  CHECK(gpu.memory().peak == 1500 * sizeof(float));
  gpu.reset_peak_memory();
  CHECK(gpu.memory().peak == 0);
}

TEST_CASE("cuda_queue: launch runs Thrust on the stream; events order queues; release frees" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  fsdp::cuda_queue q{"side"};
  auto buf = gpu.allocate(1 << 20, fsdp::mem_kind::transient);
  const std::size_t n = (1 << 20) / sizeof(float);
  q.launch([p = buf.as<float>(), n](auto policy) { thrust::sequence(policy, p, p + n); });
  const fsdp::cuda_event done = q.record();
  gpu.compute_wait(done, 10s);  // compute now runs after the sequence
  done.wait(10s, "the sequence");
  CHECK(done.ready());
  const auto host = to_host(gpu, buf.data(), n);
  CHECK(host[0] == 0.0f);
  CHECK(host[n - 1] == static_cast<float>(n - 1));
  q.release(std::move(buf));
  CHECK(!buf);
  CHECK(gpu.memory().live == 0);
  q.synchronize(10s);
  CHECK(fsdp::cuda_event{}.ready());  // default-constructed: complete
}

namespace {

// A source over cudaMalloc that counts its blocks (allocated, freed), or fails.
struct counted_source {
  std::shared_ptr<std::array<std::atomic<long>, 2>> made = std::make_shared<std::array<std::atomic<long>, 2>>();
  fsdp::cuda_memory_source source(bool fail = false) const {
    return {"counted cudaMalloc",
            [m = made, fail](std::size_t bytes) -> void* {
              if (fail) throw fsdp::error(fsdp::errc::internal, "out of counted memory");
              void* p = nullptr;
              fsdp::detail::cuda_check(cudaMalloc(&p, bytes), "cudaMalloc");
              ++(*m)[0];
              return p;
            },
            [m = made](void* p) {
              ++(*m)[1];
              (void)cudaFree(p);
            }};
  }
  long allocated() const { return (*made)[0]; }
  long freed() const { return (*made)[1]; }
};

// Holds `stream` until open() (bounded: 10 s), so work queued after it is pending meanwhile.
// Opened at the latest when it goes, and waited for: the stream's host function reads it.
struct stream_gate {
  std::atomic<bool> open_{false};
  cudaStream_t stream_;
  explicit stream_gate(cudaStream_t s) : stream_(s) {
    fsdp::detail::cuda_check(cudaLaunchHostFunc(s, [](void* g) {
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (!static_cast<stream_gate*>(g)->open_.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }, this), "cudaLaunchHostFunc");
  }
  stream_gate(const stream_gate&) = delete;
  stream_gate& operator=(const stream_gate&) = delete;
  ~stream_gate() {
    open();
    (void)cudaStreamSynchronize(stream_);
  }
  void open() { open_ = true; }
};

}  // namespace

TEST_CASE("cuda_device::use_memory: a source's blocks serve the device, reused by size once their release has run; "
          "a second source and a failing one are refused by name" * doctest::skip(!has_gpu)) {
  counted_source counted;
  {
    fsdp::cuda_device gpu{0};
    gpu.use_memory(counted.source());
    const fsdp::error twice = fsdp_test::catch_error([&] { gpu.use_memory(counted.source()); });
    CHECK(twice.code() == fsdp::errc::invalid_argument);
    CHECK(contains(twice.what(), "'counted cudaMalloc' already"));

    fsdp::cuda_queue q{"held"};
    auto a = gpu.allocate_uninitialized(4096, fsdp::mem_kind::transient);
    const void* first = a.data();
    CHECK(counted.allocated() == 1);
    stream_gate gate(q.native_handle());
    q.release(std::move(a));  // free once the gate opens
    auto b = gpu.allocate_uninitialized(4096, fsdp::mem_kind::transient);
    CHECK(counted.allocated() == 2);  // a's block is still in use by the held stream
    CHECK(b.data() != first);
    auto c = gpu.allocate_uninitialized(8192, fsdp::mem_kind::transient);
    CHECK(counted.allocated() == 3);  // another size: a new block
    gate.open();
    q.synchronize(20s);
    auto d = gpu.allocate(4096, fsdp::mem_kind::transient);  // zeroed, from a's block
    CHECK(counted.allocated() == 3);
    CHECK(d.data() == first);
    CHECK(to_host(gpu, d.data(), 1024) == std::vector<float>(1024, 0.0f));
    CHECK(gpu.memory().live == 4096 + 8192 + 4096);
    CHECK(counted.freed() == 0);
  }
  CHECK(counted.freed() == counted.allocated());  // every block went back with the device

  fsdp::cuda_device other{0};
  other.use_memory(counted.source(true));
  const fsdp::error failed = fsdp_test::catch_error([&] { auto x = other.allocate(64, fsdp::mem_kind::transient); });
  CHECK(failed.code() == fsdp::errc::internal);
  CHECK(contains(failed.what(), "'counted cudaMalloc': "));
  CHECK(contains(failed.what(), "out of counted memory"));
  CHECK(other.memory().live == 0);
  fsdp::cuda_device third{0};
  const fsdp::error half = fsdp_test::catch_error([&] { third.use_memory({"half", [](std::size_t) -> void* { return nullptr; }, {}}); });
  CHECK(half.code() == fsdp::errc::invalid_argument);
  CHECK(contains(half.what(), "'half' needs both allocate and free"));
}

TEST_CASE("nccl::communicator: one rank, every collective, host staging, groups" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  auto comm = one_rank(gpu);
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  CHECK(comm.native_handle() != nullptr);
  fsdp::cuda_queue q{"comm"};
  auto a = gpu.allocate(64 * sizeof(float), fsdp::mem_kind::transient);
  auto b = gpu.allocate(64 * sizeof(float), fsdp::mem_kind::transient);
  std::vector<float> v(64, 2.0f);
  gpu.copy_from_host(a.data(), v.data(), 64 * sizeof(float));

  comm.all_gather(a.data(), b.data(), 64, fsdp::dtype::f32, q).wait(10s, "all_gather");
  CHECK(to_host(gpu, b.data(), 64) == v);
  comm.all_reduce(a.data(), a.data(), 64, fsdp::dtype::f32, fsdp::reduce_op::avg, q).wait(10s, "all_reduce");
  CHECK(to_host(gpu, a.data(), 64) == v);
  comm.reduce_scatter(a.data(), b.data(), 64, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(10s, "reduce_scatter");
  comm.broadcast(b.data(), 64, fsdp::dtype::f32, 0, q).wait(10s, "broadcast");
  CHECK(to_host(gpu, b.data(), 64) == v);

  double x = 3.5;  // host memory: staged, done on return
  const fsdp::cuda_event e = comm.all_reduce(&x, &x, 1, fsdp::dtype::f64, fsdp::reduce_op::sum, q);
  CHECK(e.ready());
  CHECK(x == 3.5);

  fsdp::cuda_event grouped;
  {
    fsdp::nccl::group g;
    grouped = comm.all_reduce(a.data(), a.data(), 64, fsdp::dtype::f32, fsdp::reduce_op::sum, q);
  }
  grouped.wait(10s, "grouped all_reduce");

  const fsdp::traffic_counters t = comm.traffic();
  CHECK(t.collectives == 6);
  CHECK(t.total() == 0);  // one rank sends nothing

  comm.barrier();
  auto sub = comm.split(0, 0);
  CHECK(sub.size() == 1);

  const fsdp::error overlap = fsdp_test::catch_error(
      [&] { comm.reduce_scatter(a.data(), a.as<float>() + 1, 8, fsdp::dtype::f32, fsdp::reduce_op::sum, q); });
  CHECK(overlap.code() == fsdp::errc::invalid_argument);
  const fsdp::error ints = fsdp_test::catch_error(
      [&] { comm.all_reduce(a.data(), a.data(), 8, fsdp::dtype::i32, fsdp::reduce_op::sum, q); });
  CHECK(ints.code() == fsdp::errc::unsupported_dtype);

  comm.abort("test");
  CHECK(comm.aborted());
  const fsdp::error after = fsdp_test::catch_error([&] { comm.barrier(); });
  CHECK(after.code() == fsdp::errc::peer_failure);
  CHECK(contains(after.what(), "test"));
}

TEST_CASE("shard_group on one GPU: initial values, gradients and an SGD step" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  auto comm = one_rank(gpu);
  fsdp::buffer<float> w(300, "w"), b(7, "b");
  fsdp::shard_group<fsdp::buffer<float>, fsdp::nccl::communicator> group{comm, gpu};
  group.add_unit({&w, &b});
  group.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> out) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(s.offset + i) + 0.5f * static_cast<float>(s.index);
  }));
  fsdp::sgd opt{group, {.lr = 0.5f}};
  {
    auto scope = group.forward(0);
    REQUIRE(w.data() != nullptr);
  }
  {
    auto scope = group.backward(0);
    thrust::fill(gpu.execution_policy(), w.grad(), w.grad() + 300, 2.0f);
    thrust::fill(gpu.execution_policy(), b.grad(), b.grad() + 7, 4.0f);
  }
  opt.step();
  const auto gw = group.full_gradient(0, 0);
  const auto pw = group.full_parameter(0, 0);
  const auto pb = group.full_parameter(0, 1);
  REQUIRE(gw.size() == 300);
  CHECK(gw[17] == 2.0f);
  CHECK(pw[17] == doctest::Approx(17.0f - 0.5f * 2.0f));
  CHECK(pb[3] == doctest::Approx(3.5f - 0.5f * 4.0f));
  CHECK(group.memory().transient_live == 0);
}

TEST_CASE("shard_group on one GPU: AdamW's step, the gradient norm and device timing refuse a CUDA graph capture by name" * doctest::skip(!has_gpu)) {
  fsdp::cuda_device gpu{0};
  auto comm = one_rank(gpu);
  fsdp::buffer<float> w(300, "w");
  fsdp::shard_group<fsdp::buffer<float>, fsdp::nccl::communicator> group{comm, gpu};
  group.add_unit({&w});
  group.finalize(fsdp::init::per_shard([](const fsdp::param_slice&, std::span<float> out) { std::fill(out.begin(), out.end(), 1.0f); }));
  fsdp::adamw opt{group, {.lr = 0.5f}};
  auto train = [&] {
    { auto scope = group.forward(0); }
    {
      auto scope = group.backward(0);
      thrust::fill(gpu.execution_policy(), w.grad(), w.grad() + 300, 2.0f);
    }
    opt.step();
  };
  train();
  for (auto step : {std::function<void()>([&] { opt.step(); }), std::function<void()>([&] { (void)fsdp::grad_norm(group); })}) {
    const fsdp::error e = fsdp_test::catch_error([&] { fsdp::cuda_graph::capture(gpu, step); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(contains(e.what(), "inside a CUDA graph capture"));
  }
  CHECK(opt.steps() == 1);  // refused before anything changed
  train();  // and the group still trains outside a capture
  CHECK(opt.steps() == 2);
  CHECK(group.full_parameter(0, 0)[5] < 1.0f);
  group.time_on_device();
  const fsdp::error timed = fsdp_test::catch_error([&] { fsdp::cuda_graph::capture(gpu, [&] { auto scope = group.forward(0); }); });
  CHECK(timed.code() == fsdp::errc::invalid_argument);
  CHECK(contains(timed.what(), "time_on_device"));
}
