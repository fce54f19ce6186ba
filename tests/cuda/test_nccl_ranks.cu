// Tests of the NCCL backend with several ranks on the one GPU of the lent machines. Each rank is a
// process of this test executable, started by examples/common/process_ranks.hpp with its own
// NCCL_HOSTID, so that NCCL 2.28 (which refuses a duplicate GPU within a host) connects them
// through its socket transport; and where the NCCL loaded is 2.30 or later, the same scenarios run
// again, after every process case, with each rank a thread of this process
// (examples/common/nccl_thread_ranks.hpp: NCCL_MULTI_RANK_GPU_ENABLE, NCCL's transport on the
// device). The ranks write what they computed into a file_store folder; the test compares it with
// the host threads backend on the same inputs (tests/common/gpu_parity.hpp, the same comparisons
// test_threads_cuda makes for thread ranks over CUDA). The host-wait count runs on processes only:
// its counters are the process's, and thread ranks would count each other's calls.
//
// NCCL reduces in its own order (a ring: rank r's partial sum passes r - 1 additions before it),
// and bf16 partial sums are rounded at each hop, where the host backend adds in rank order in
// float and rounds once. So gathers, broadcasts and all_to_all must match bit for bit; reductions
// within 1e-6 (f32) and 1e-2 (bf16: at most n - 1 = 3 roundings of 2^-9 each); the parameters
// after three SGD steps within 1e-6 (f32) and 1e-2 (bf16 parameters, f32 reduction).
//
// Without a usable GPU (the build machines and CI) the no-device case runs: every rank process
// fails with "no CUDA device" and the launcher reports each, without hanging.

#include "fsdp/comm/nccl.hpp"
#include "fsdp/fsdp.hpp"

#include <doctest/doctest.h>

#include "common/catch_error.hpp"
#include "common/cuda_api_counter.hpp"
#include "common/gpu.hpp"
#include "common/gpu_parity.hpp"
#include "common/nccl_thread_ranks.hpp"
#include "common/process_ranks.hpp"

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

// One rank's part (below), whether the rank is a process or a thread (thread_ranks). meet(): the
// ranks meet on the host (thread ranks: common/nccl_thread_ranks.hpp says why; processes need not).
void run_scenario(const std::string& scenario, fsdp::nccl::communicator& comm, const fsdp::cuda_device& gpu, const fsdp::file_store& store,
                  bool thread_ranks, const std::function<void()>& meet);
std::chrono::milliseconds scenario_timeout(const std::string& scenario);

namespace {

using namespace std::chrono_literals;
using fsdp_test::contains;
using fsdp_test::has_gpu;

// The case a rank process runs; FSDP_TEST_SCENARIO says what it does.
constexpr const char* rank_case = "nccl rank process";
const bool is_rank = example::this_process_rank().has_value();

// Keys of what the ranks store.
template <class T>
std::string collective_key(fsdp::reduce_op op, std::size_t count, int rank) {
  return "c_" + std::string(fsdp::to_string(fsdp::dtype_of<T>)) + "_" + std::string(fsdp::to_string(op)) + "_" +
         std::to_string(count) + "_" + std::to_string(rank);
}
const std::vector<std::size_t> counts{1, 1000, std::size_t{1} << 18};

// One run of the model of gpu_parity.hpp: the sharding, bf16 or f32 parameters, offload,
// frozen b1; named for its key and for CAPTURE.
struct model_run {
  std::string name;
  fsdp::sharding sharding;
  bool bf16 = false;
  fsdp_test::run_config config{};
};
// On thread ranks without the offloaded run: allocating pinned host memory waits for the whole
// device, where a peer's first collective of the run may already spin for this rank
// (common/nccl_thread_ranks.hpp).
std::vector<model_run> model_runs(int n, bool thread_ranks) {
  const fsdp::sharding hpz{.shard_size = 0, .reshard_after_forward = true, .reshard_after_forward_to = 2};
  std::vector<model_run> runs;
  for (const fsdp::sharding& s : {fsdp::full_shard(), fsdp::shard_grad_op(), fsdp::hybrid_shard(2), fsdp::no_shard()})
    for (bool bf16 : {false, true}) {
      std::string name = fsdp::to_string(s) + (bf16 ? "_bf16" : "_f32");  // "full_shard()_f32": a store key
      std::erase_if(name, [](char ch) { return ch == '(' || ch == ')' || ch == ' ' || ch == ','; });
      runs.push_back({name, s, bf16});
    }
  if (!thread_ranks) runs.push_back({"full_offload", fsdp::full_shard(), false, {.offload = true}});
  runs.push_back({"full_frozen_b1", fsdp::full_shard(), false, {.freeze_b1 = true}});
  if (n == 4) runs.push_back({"hpz_to_2", hpz, false});
  return runs;
}

// train_three_steps on `comm`: a GPU backend on `gpu`, or the host threads backend.
template <class P, class Comm>
std::vector<float> train_on(Comm& comm, [[maybe_unused]] const fsdp::cuda_device* gpu, const model_run& m) {
  using precision = std::conditional_t<std::is_same_v<P, float>, fsdp::full_precision<float>, fsdp::mixed_precision<fsdp::bf16, float, float>>;
  // Named before the options: nvcc 13.0's cicc crashes on this conditional inside them.
  const fsdp::offload off = m.config.offload ? fsdp::offload_all() : fsdp::offload{};
  if constexpr (std::is_same_v<Comm, fsdp::threads::communicator>) {
    fsdp::shard_group<fsdp::buffer<P>, precision, Comm> group{comm, {}, {.sharding = m.sharding, .offload = off}};
    return fsdp_test::train_three_steps(group, fsdp_test::host_fill(), m.config);
  } else {
    fsdp::shard_group<fsdp::buffer<P>, precision, Comm> group{comm, *gpu, {.sharding = m.sharding, .offload = off}};
    return fsdp_test::train_three_steps(group, fsdp_test::gpu_fill(*gpu), m.config);
  }
}

// The registered scenario's fourth unit: gathers of 8 MiB (f32, two ranks), NCCL's Simple protocol.
constexpr std::size_t registered_big = std::size_t{1} << 21;

// What a run of train_six_steps gives: the full parameters after it, and with a graph its node
// count, the change of the device's live bytes over the capture, and the optimizer's step count
// after the four launches. (A launch runs no host code of the step, so there are no host waits
// in it to count: a step that waits cannot be captured, refused by name.)
struct six_steps {
  std::vector<float> full;
  std::array<long, 3> graph{};  // nodes, live bytes' change, steps()
};

// Six steps of SGD (momentum 0.9) or capturable AdamW clipped on the device (clip_on_device, a
// max_norm that clips every step) and following a learning-rate schedule (set_lr between
// launches) of three fully sharded units on NCCL ranks, each unit's
// gradient computed on the GPU from its parameters (gradient_of). With
// `graph`, steps 3 to 6 are four launches of a CUDA graph captured from step 3 (steps 1 and 2
// run eagerly: the first records the unit order, the second is the first to replay the plan).
// The full parameters after them. `big` > 0 adds a fourth unit of that many elements, whose
// gathers are large enough for NCCL's Simple protocol (the small ones take LL, which NCCL never
// runs on registered buffers: 2.30.7's coll_reg.cc). `before_capture` (thread ranks: their host
// meeting) runs after the eager steps: a capture in one rank's thread while a peer's thread still
// issues eager steps in the same CUDA context is what CUDA leaves unsaid.
template <class P, bool AdamW>
six_steps train_six_steps(fsdp::nccl::communicator& comm, const fsdp::cuda_device& gpu, bool graph, std::size_t big = 0,
                          const std::function<void()>& before_capture = {}) {
  using precision = std::conditional_t<std::is_same_v<P, float>, fsdp::full_precision<float>, fsdp::mixed_precision<fsdp::bf16, float, float>>;
  fsdp::shard_group<fsdp::buffer<P>, precision, fsdp::nccl::communicator> group{comm, gpu};
  fsdp::buffer<P> w1(300, "w1"), b1(7, "b1"), w2(129, "w2"), w3(1000, "w3"), w4(big ? big : 1, "w4");
  std::vector<std::vector<fsdp::buffer<P>*>> units{{&w1, &b1}, {&w2}, {&w3}};
  if (big) units.push_back({&w4});
  const int n = static_cast<int>(units.size());
  for (const auto& u : units) group.add_unit(u);
  group.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> v) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>((s.offset + i) % 101) - 0.3f * static_cast<float>(s.index);
  }));
  using optimizer = std::conditional_t<AdamW, fsdp::adamw<decltype(group)>, fsdp::sgd<decltype(group)>>;
  optimizer opt = [&] {
    if constexpr (AdamW) return optimizer{group, {.lr = 0.01f, .capturable = true}};
    else return optimizer{group, {.lr = 0.1f, .momentum = 0.9f}};
  }();
  auto fill = fsdp_test::gpu_fill(gpu);
  auto step = [&] {
    for (int u = 0; u < n; ++u) auto scope = group.forward(u);
    for (int u = n; u-- > 0;) {
      auto scope = group.backward(u);
      for (fsdp::buffer<P>* q : units[static_cast<std::size_t>(u)])
        fill(fsdp_test::gradient_of<P>{q->data(), q->grad(), static_cast<float>(group.rank())}, q->size());
    }
    if constexpr (AdamW) opt.step(fsdp::clip_on_device(group, 1e-3));
    else opt.step();
    opt.zero_grad();
  };
  // AdamW follows a decaying learning rate, set between launches (set_lr writes the device's
  // copy the captured step reads); SGD keeps its lr.
  auto set_lr = [&](int s) {
    if constexpr (AdamW) opt.set_lr(0.01f / static_cast<float>(s + 1));
  };
  six_steps r;
  for (int s = 0; s < 2; ++s) {
    set_lr(s);
    step();
  }
  if (graph) {
    if (before_capture) before_capture();
    set_lr(2);
    const auto live = static_cast<long>(gpu.memory().live);
    const fsdp::cuda_graph g = fsdp::cuda_graph::capture(gpu, step);
    r.graph[0] = static_cast<long>(g.nodes());
    r.graph[1] = static_cast<long>(gpu.memory().live) - live;
    for (int s = 2; s < 6; ++s) {
      set_lr(s);
      g.launch(gpu.compute_stream());
    }
    gpu.synchronize(60s);
    r.graph[2] = opt.steps();
  } else {
    for (int s = 2; s < 6; ++s) {
      set_lr(s);
      step();
    }
  }
  for (int u = 0; u < n; ++u)
    for (std::size_t k = 0; k < units[static_cast<std::size_t>(u)].size(); ++k)
      for (const float x : group.full_parameter(u, static_cast<int>(k))) r.full.push_back(x);
  return r;
}

// How the ranks run: processes of this test (any NCCL), or threads of this process (NCCL 2.30+).
enum class launch { processes, threads };
// Whether the NCCL loaded lets thread ranks share the GPU (2.30 on); processes run on any.
const bool nccl_threads = example::nccl_version() >= 23000;

// The ranks of a scenario, their store in a fresh folder: n copies of this test running
// rank_case (processes), or n threads of this one (threads, bounded by the communicators'
// timeout where processes are by `timeout`).
struct ranks_run {
  std::filesystem::path store;
  launch how;
  std::vector<example::rank_exit> exits;  // processes: how each ended
  std::string failure;                    // threads: the root cause, when a rank failed
  explicit ranks_run(int n, const std::string& scenario, launch how_ = launch::processes, std::chrono::seconds timeout = 240s)
      : how(how_) {
    static std::atomic<int> runs{0};
    store = std::filesystem::temp_directory_path() / ("fsdp-nccl-ranks-" + std::to_string(getpid()) + "-" + std::to_string(runs++));
    std::filesystem::remove_all(store);
    if (how == launch::processes) {
      exits = example::spawn_process_ranks({.ranks = n,
                                            .args = {std::string("--test-case=") + rank_case, "--no-version"},
                                            .env = {"FSDP_TEST_SCENARIO=" + scenario},
                                            .store = store,
                                            .timeout = timeout,
                                            .grace = 30s});
      return;
    }
    std::filesystem::create_directories(store);
    try {
      example::run_nccl_thread_ranks({.ranks = n, .timeout = scenario_timeout(scenario)},
                                     [&](fsdp::nccl::communicator& comm, const fsdp::cuda_device& gpu, const std::function<void()>& meet) {
                                       run_scenario(scenario, comm, gpu, fsdp::file_store{store}, true, meet);
                                     });
    } catch (const std::exception& e) {
      failure = e.what();
    } catch (...) {  // a doctest assertion that stopped a rank (REQUIRE, FAIL): doctest reports it
      failure = "a rank stopped at a failed assertion";
    }
  }
  ~ranks_run() {
    std::error_code ec;
    std::filesystem::remove_all(store, ec);
  }
  bool all_ok() const {
    for (const auto& e : exits)
      if (!e.ok()) return false;
    return failure.empty();
  }
  std::string describe() const {
    if (how == launch::processes) return example::describe(exits);
    return failure.empty() ? "every thread rank returned" : "thread ranks: " + failure;
  }
  std::vector<std::byte> get(const std::string& key) const { return fsdp::file_store{store}.get(key, 1s); }
  // A value a rank stored whole (put(key, &x, sizeof x)); its size is checked.
  template <class T>
  T value(const std::string& key) const {
    const std::vector<std::byte> v = get(key);
    REQUIRE(v.size() == sizeof(T));
    T x;
    std::memcpy(&x, v.data(), sizeof x);
    return x;
  }
};

// Compares a rank's collective outputs with the host's: bits where nothing is added, within
// `tol` (relative) where something is.
template <class T>
void check_collectives(const std::vector<std::byte>& gpu, const std::vector<std::byte>& host, int n, std::size_t count, double tol) {
  const fsdp_test::collective_parts at(n, count, sizeof(T));
  REQUIRE(gpu.size() == host.size());
  auto same_bits = [&](std::size_t off, std::size_t bytes) { return std::memcmp(gpu.data() + off, host.data() + off, bytes) == 0; };
  CHECK(same_bits(at.all_gather(), at.full));
  CHECK(same_bits(at.broadcast(), at.part));
  CHECK(same_bits(at.all_to_all(), at.full));
  auto close = [&](std::size_t off, std::size_t bytes) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < bytes / sizeof(T); ++i) {
      T a, b;
      std::memcpy(&a, gpu.data() + off + i * sizeof(T), sizeof(T));
      std::memcpy(&b, host.data() + off + i * sizeof(T), sizeof(T));
      const double x = fsdp::convert<float>(a), y = fsdp::convert<float>(b);
      if (std::abs(x - y) > tol * std::abs(y)) ++bad;
    }
    return bad;
  };
  CHECK(close(at.reduce_scatter(), at.part) == 0);
  CHECK(close(at.all_reduce(), at.full) == 0);
  CHECK(close(at.all_reduce_in_place(), at.full) == 0);
}

}  // namespace

// --- one rank, a process or a thread ----------------------------------------------------------
// The missing rank is found at the communicator's timeout (run_scenario): short there.
std::chrono::milliseconds scenario_timeout(const std::string& scenario) {
  using namespace std::chrono_literals;
  return scenario == "missing_rank" ? 8s : 60s;
}

// What rank `comm.rank()` does in `scenario`, storing its results in `store`.
void run_scenario(const std::string& scenario, fsdp::nccl::communicator& comm, const fsdp::cuda_device& gpu, const fsdp::file_store& store,
                  bool thread_ranks, const std::function<void()>& meet) {
  const struct {
    int rank, size;
  } me{comm.rank(), comm.size()};
  auto put = [&](const std::string& key, const void* p, std::size_t bytes) {
    store.set(key, std::span(static_cast<const std::byte*>(p), bytes));
  };
  if (scenario == "collectives") {
    for (fsdp::reduce_op op : {fsdp::reduce_op::sum, fsdp::reduce_op::avg})
      for (std::size_t count : counts) {
        const auto f = fsdp_test::gpu_collectives<float>(comm, gpu, count, op);
        put(collective_key<float>(op, count, me.rank), f.data(), f.size());
        const auto b = fsdp_test::gpu_collectives<fsdp::bf16>(comm, gpu, count, op);
        put(collective_key<fsdp::bf16>(op, count, me.rank), b.data(), b.size());
      }
    // A split as HSDP makes it (ranks of equal color, ordered by key): the sum of the world
    // ranks of this rank's color, through host memory (staged).
    auto sub = comm.split(me.rank % 2, me.rank);
    fsdp::cuda_queue q{"split"};
    double x = me.rank;
    sub.all_reduce(&x, &x, 1, fsdp::dtype::f64, fsdp::reduce_op::sum, q);
    const int sub_rank = sub.rank(), sub_size = sub.size();
    put("split_" + std::to_string(me.rank), &x, sizeof x);
    put("split_rank_" + std::to_string(me.rank), &sub_rank, sizeof sub_rank);
    put("split_size_" + std::to_string(me.rank), &sub_size, sizeof sub_size);
    comm.barrier();
  } else if (scenario == "shard_group") {
    for (const model_run& m : model_runs(me.size, thread_ranks)) {
      if (m.sharding == fsdp::hybrid_shard(2) && me.size % 2 != 0) continue;
      const std::vector<float> full = m.bf16 ? train_on<fsdp::bf16>(comm, &gpu, m) : train_on<float>(comm, &gpu, m);
      meet();  // no rank tears a run down (which may wait for the device) while a peer's next has begun
      if (me.rank == 0) put("model_" + m.name, full.data(), full.size() * sizeof(float));
    }
  } else if (scenario == "host_waits") {
    // A bf16 AdamW step of three fully sharded units, as train_gpt's: after two warm-up steps,
    // how often the host waits for the GPU in the hooks, opt.step() and zero_grad() (fsdp's own
    // bounded waits, and every synchronizing CUDA call anyone makes), and in clip_grad_norm().
    fsdp_test::cuda_api_counter api;
    using precision = fsdp::mixed_precision<fsdp::bf16, float, float>;
    fsdp::shard_group<fsdp::buffer<fsdp::bf16>, precision, fsdp::nccl::communicator> group{comm, gpu};
    fsdp::buffer<fsdp::bf16> w1(300, "w1"), b1(7, "b1"), w2(129, "w2"), w3(1000, "w3");
    const std::vector<std::vector<fsdp::buffer<fsdp::bf16>*>> units{{&w1, &b1}, {&w2}, {&w3}};
    for (const auto& u : units) group.add_unit(u);
    group.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * static_cast<float>((s.offset + i) % 89);
    }));
    fsdp::adamw opt{group, {.lr = 1e-3f}};
    auto fill = fsdp_test::gpu_fill(gpu);
    auto forward_backward = [&] {
      for (int u = 0; u < 3; ++u) auto scope = group.forward(u);
      for (int u = 3; u-- > 0;) {
        auto scope = group.backward(u);
        for (fsdp::buffer<fsdp::bf16>* q : units[static_cast<std::size_t>(u)])
          fill(fsdp_test::gradient_of<fsdp::bf16>{q->data(), q->grad(), static_cast<float>(me.rank)}, q->size());
      }
    };
    std::array<long, 9> counts{};
    for (int step = 0; step < 3; ++step) {
      const long waits0 = fsdp::cuda_host_waits(), syncs0 = api.synchronizations(), allocs0 = api.allocations();
      forward_backward();
      group.finish_backward();
      const long waits1 = fsdp::cuda_host_waits(), syncs1 = api.synchronizations(), allocs1 = api.allocations();
      fsdp::clip_grad_norm(group, 1.0);
      const long waits2 = fsdp::cuda_host_waits(), syncs2 = api.synchronizations(), allocs2 = api.allocations();
      opt.step();
      opt.zero_grad();
      const long waits3 = fsdp::cuda_host_waits(), syncs3 = api.synchronizations(), allocs3 = api.allocations();
      // The step without clipping, then clipping alone.
      counts = {waits1 - waits0 + waits3 - waits2, syncs1 - syncs0 + syncs3 - syncs2, allocs1 - allocs0 + allocs3 - allocs2,
                     waits2 - waits1, syncs2 - syncs1, allocs2 - allocs1};
    }
    // A fourth step clipped on the device (clip_on_device): the whole step, clipping included.
    const long waits0 = fsdp::cuda_host_waits(), syncs0 = api.synchronizations(), allocs0 = api.allocations();
    forward_backward();
    opt.step(fsdp::clip_on_device(group, 1.0));
    opt.zero_grad();
    counts[6] = fsdp::cuda_host_waits() - waits0;
    counts[7] = api.synchronizations() - syncs0;
    counts[8] = api.allocations() - allocs0;
    gpu.synchronize(60s);
    put("host_waits_" + std::to_string(me.rank), counts.data(), sizeof counts);
  } else if (scenario == "graph") {
    for (const std::string dt : {"f32", "bf16", "adamw"}) {
      auto train = [&](bool graph) {
        if (dt == "f32") return train_six_steps<float, false>(comm, gpu, graph, 0, meet);
        if (dt == "bf16") return train_six_steps<fsdp::bf16, false>(comm, gpu, graph, 0, meet);
        return train_six_steps<fsdp::bf16, true>(comm, gpu, graph, 0, meet);
      };
      const six_steps eager = train(false);
      meet();
      const six_steps launched = train(true);
      meet();
      const std::string me_key = "_" + dt + "_" + std::to_string(me.rank);
      put("graph_eager" + me_key, eager.full.data(), eager.full.size() * sizeof(float));
      put("graph_launched" + me_key, launched.full.data(), launched.full.size() * sizeof(float));
      put("graph_meta" + me_key, launched.graph.data(), sizeof launched.graph);
    }
  } else if (scenario == "registered") {
    // The same six SGD steps with the group's buffers in fsdp's pool and in NCCL's registered
    // memory (nccl::registered_memory, on a device of its own: use_memory is once a device),
    // eagerly and with steps 3 to 6 launched from a captured graph (its buffers the graph's, the
    // shards still registered). The source counted: its blocks served the group, and each went back.
    for (const std::string dt : {"f32", "bf16"}) {
      auto train = [&](const fsdp::cuda_device& on, bool graph) {
        return dt == "f32" ? train_six_steps<float, false>(comm, on, graph, registered_big, meet)
                           : train_six_steps<fsdp::bf16, false>(comm, on, graph, registered_big, meet);
      };
      const six_steps pool = train(gpu, false);
      meet();
      auto made = std::make_shared<std::array<std::atomic<long>, 2>>();  // blocks allocated, freed
      six_steps registered, launched;
      {
        const fsdp::cuda_device reg{gpu.ordinal()};
        fsdp::cuda_memory_source source = fsdp::nccl::registered_memory(comm);
        reg.use_memory({source.name, [a = source.allocate, made](std::size_t bytes) {
                          void* p = a(bytes);
                          ++(*made)[0];
                          return p;
                        },
                        [f = source.free, made](void* p) {
                          ++(*made)[1];
                          f(p);
                        }});
        registered = train(reg, false);
        meet();
        launched = train(reg, true);
        meet();
      }
      meet();  // the blocks went back to NCCL (unmapping may wait for the device) before a peer goes on
      const std::array<long, 2> blocks{(*made)[0].load(), (*made)[1].load()};
      const std::string me_key = "_" + dt + "_" + std::to_string(me.rank);
      put("reg_pool" + me_key, pool.full.data(), pool.full.size() * sizeof(float));
      put("reg_registered" + me_key, registered.full.data(), registered.full.size() * sizeof(float));
      put("reg_launched" + me_key, launched.full.data(), launched.full.size() * sizeof(float));
      put("reg_blocks" + me_key, blocks.data(), sizeof blocks);
    }
  } else if (scenario == "rank_fails") {
    // Thread ranks only: both sum once (NCCL connects them), then rank 1 throws. Rank 0's next
    // all_reduce waits for a peer that is gone: the launcher's word (watch_peers) must end that
    // wait at once, naming rank 1's error, well before the communicator's timeout (60 s).
    fsdp::cuda_queue q{"fails"};
    auto b = gpu.allocate(1024 * sizeof(float), fsdp::mem_kind::transient);
    comm.all_reduce(b.data(), b.data(), 1024, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(20s, "the first all_reduce");
    if (me.rank == 1) throw std::runtime_error("rank 1 gives up on purpose");
    const auto t0 = std::chrono::steady_clock::now();
    const fsdp::error e = fsdp_test::catch_error(
        [&] { comm.all_reduce(b.data(), b.data(), 1024, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(50s, "the all_reduce rank 1 left"); });
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string what = std::string(fsdp::to_string(e.code())) + ": " + e.what();
    put("fails_error", what.data(), what.size());
    put("fails_waited", &waited, sizeof waited);
  } else if (scenario == "missing_rank") {
    // Rank 1 never joins rank 0's all_reduce: rank 0 must stop within the communicator's
    // timeout (8 s) with an error naming the collective, and abort the communicator; nobody
    // hangs. (NCCL connects peers lazily, at their first collective, so the issue itself waits
    // for the missing peer: the communicator's timeout bounds it, not the event wait's 3 s.)
    if (me.rank == 0) {
      fsdp::cuda_queue q{"lonely"};
      auto b = gpu.allocate(1024 * sizeof(float), fsdp::mem_kind::transient);
      const auto t0 = std::chrono::steady_clock::now();
      const fsdp::error e = fsdp_test::catch_error(
          [&] { comm.all_reduce(b.data(), b.data(), 1024, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(3s, "the lonely all_reduce"); });
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const std::string what = std::string(fsdp::to_string(e.code())) + ": " + e.what();
      put("missing_error", what.data(), what.size());
      put("missing_waited", &waited, sizeof waited);
      CHECK(comm.aborted());
    } else {
      std::this_thread::sleep_for(8s);  // gone without joining, after rank 0 gave up
    }
  } else {
    FAIL("unknown FSDP_TEST_SCENARIO '" << scenario << "'");
  }
}

TEST_CASE("nccl rank process" * doctest::skip(!is_rank)) {
  const example::process_rank me = *example::this_process_rank();
  const std::string scenario = std::getenv("FSDP_TEST_SCENARIO") ? std::getenv("FSDP_TEST_SCENARIO") : "";
  const fsdp::file_store store{me.store};
  fsdp::cuda_device gpu{0};
  auto comm = fsdp::nccl::communicator::from_file_store(gpu, me.rank, me.size, store, scenario_timeout(scenario));
  run_scenario(scenario, comm, gpu, store, false, [] {});
}

// --- the tests ---------------------------------------------------------------------------------
TEST_CASE("nccl ranks as processes: without a usable GPU every rank fails by name, and the launcher ends" * doctest::skip(has_gpu)) {
  const ranks_run run(2, "collectives", launch::processes, 60s);
  REQUIRE(run.exits.size() == 2);
  for (const auto& e : run.exits) {
    CAPTURE(e.str());
    CHECK(e.code == 1);  // doctest's failure exit: cuda_device's no_device error, not a crash or a kill
    CHECK(!e.killed);
  }
}

TEST_CASE("nccl ranks as threads: refused by name before NCCL 2.30 and with CUDA's lazy loading; else, without a usable GPU, "
          "every rank fails by name" * doctest::skip(has_gpu && nccl_threads)) {
  const int v = example::nccl_version();
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  const bool eager = loading != nullptr && std::string(loading) == "EAGER";
  CAPTURE(v);
  CAPTURE(eager);
  const fsdp::error e = fsdp_test::catch_error([] {
    example::run_nccl_thread_ranks({.ranks = 2, .timeout = 20s},
                                   [](fsdp::nccl::communicator&, const fsdp::cuda_device&, const std::function<void()>&) {
                                     FAIL("no rank can run here");
                                   });
  });
  const std::string what = e.what();
  CAPTURE(what);
  if (v < 23000) {
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(contains(what, "NCCL " + example::nccl_version_string(v) + " refuses ranks of one communicator that share a GPU"));
    CHECK(contains(what, "NCCL 2.30 or later"));
  } else if (!eager) {
    CHECK(e.code() == fsdp::errc::invalid_argument);
    CHECK(contains(what, "run with CUDA_MODULE_LOADING=EAGER"));
  } else {
    CHECK(e.code() == fsdp::errc::no_device);  // the root cause, not a rank's wait for a peer
  }
}

namespace {

// Every collective on 2 and 4 ranks, and a split, against the host threads backend.
void collectives_case(launch how) {
  for (int n : {2, 4}) {
    CAPTURE(n);
    const ranks_run run(n, "collectives", how);
    INFO(run.describe());
    REQUIRE(run.all_ok());
    for (fsdp::reduce_op op : {fsdp::reduce_op::sum, fsdp::reduce_op::avg})
      for (std::size_t count : counts) {
        CAPTURE(fsdp::to_string(op));
        CAPTURE(count);
        std::vector<std::vector<std::byte>> host_f(static_cast<std::size_t>(n)), host_b(static_cast<std::size_t>(n));
        fsdp::threads::world{n, {.timeout = 20s}}.run([&](fsdp::threads::communicator& host) {
          host_f[static_cast<std::size_t>(host.rank())] = fsdp_test::host_collectives<float>(host, count, op);
          host_b[static_cast<std::size_t>(host.rank())] = fsdp_test::host_collectives<fsdp::bf16>(host, count, op);
        });
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          check_collectives<float>(run.get(collective_key<float>(op, count, r)), host_f[static_cast<std::size_t>(r)], n, count, 1e-6);
          check_collectives<fsdp::bf16>(run.get(collective_key<fsdp::bf16>(op, count, r)), host_b[static_cast<std::size_t>(r)], n, count, 1e-2);
        }
      }
    for (int r = 0; r < n; ++r) {
      const auto sum = run.value<double>("split_" + std::to_string(r));
      const auto sub_rank = run.value<int>("split_rank_" + std::to_string(r));
      const auto sub_size = run.value<int>("split_size_" + std::to_string(r));
      double want = 0;
      for (int s = r % 2; s < n; s += 2) want += s;
      CHECK(sum == want);
      CHECK(sub_rank == r / 2);
      CHECK(sub_size == n / 2);
    }
  }
}

// shard_group on 2 and 4 ranks in every sharding (bf16, frozen, hpZ; offload on processes) against
// the host backend.
void shard_group_case(launch how) {
  for (int n : {2, 4}) {
    CAPTURE(n);
    const ranks_run run(n, "shard_group", how);
    INFO(run.describe());
    REQUIRE(run.all_ok());
    for (const model_run& m : model_runs(n, how == launch::threads)) {
      CAPTURE(m.name);
      std::vector<float> host;
      std::mutex mu;
      fsdp::threads::world{n, {.timeout = 30s}}.run([&](fsdp::threads::communicator& c) {
        std::vector<float> full = m.bf16 ? train_on<fsdp::bf16>(c, nullptr, m) : train_on<float>(c, nullptr, m);
        std::lock_guard lock(mu);
        if (c.rank() == 0) host = std::move(full);
      });
      const std::vector<std::byte> bytes = run.get("model_" + m.name);
      REQUIRE(bytes.size() == host.size() * sizeof(float));
      std::vector<float> gpu(host.size());
      std::memcpy(gpu.data(), bytes.data(), bytes.size());
      const double tol = m.bf16 ? 1e-2 : 1e-6;
      for (std::size_t i = 0; i < gpu.size(); ++i) CHECK(gpu[i] == doctest::Approx(host[i]).epsilon(tol));
    }
  }
}

// A step captured as a CUDA graph and launched four times against four eager steps, bit for bit.
void graph_case(launch how) {
  const ranks_run run(2, "graph", how);
  INFO(run.describe());
  REQUIRE(run.all_ok());
  for (const std::string dt : {"f32", "bf16", "adamw"})
    for (int r = 0; r < 2; ++r) {
      CAPTURE(dt);
      CAPTURE(r);
      const std::string key = "_" + dt + "_" + std::to_string(r);
      const std::vector<std::byte> eager = run.get("graph_eager" + key), launched = run.get("graph_launched" + key);
      REQUIRE(eager.size() == (300 + 7 + 129 + 1000) * sizeof(float));
      REQUIRE(launched.size() == eager.size());
      std::size_t differ = 0;
      for (std::size_t i = 0; i < eager.size(); i += sizeof(float)) differ += std::memcmp(eager.data() + i, launched.data() + i, sizeof(float)) != 0;
      CHECK(differ == 0);
      const auto meta = run.value<std::array<long, 3>>("graph_meta" + key);
      MESSAGE("rank " << r << ", " << dt << ": a captured step of " << meta[0] << " graph nodes");
      CHECK(meta[0] > 0);
      CHECK(meta[1] == 0);  // the step's buffers are the graph's, allocated and freed inside it
      if (dt == "adamw") CHECK(meta[2] == 6);  // the launches advanced the count in the device's memory
    }
}

// The group's buffers in NCCL's registered memory train as in fsdp's pool, bit for bit (two
// ranks: a sum of two is the same in any order NCCL's zero-copy path may take), eagerly and
// from a captured graph; the blocks came from the source and went back to it.
void registered_case(launch how) {
  const ranks_run run(2, "registered", how);
  INFO(run.describe());
  REQUIRE(run.all_ok());
  for (const std::string dt : {"f32", "bf16"})
    for (int r = 0; r < 2; ++r) {
      CAPTURE(dt);
      CAPTURE(r);
      const std::string key = "_" + dt + "_" + std::to_string(r);
      const std::vector<std::byte> pool = run.get("reg_pool" + key);
      REQUIRE(pool.size() == (300 + 7 + 129 + 1000 + registered_big) * sizeof(float));
      CHECK(run.get("reg_registered" + key) == pool);
      CHECK(run.get("reg_launched" + key) == pool);
      const auto blocks = run.value<std::array<long, 2>>("reg_blocks" + key);
      MESSAGE("rank " << r << ", " << dt << ": " << blocks[0] << " registered blocks for two groups (eager, graph) of four units");
      CHECK(blocks[0] > 0);
      CHECK(blocks[1] == blocks[0]);
    }
}

// A rank that never joins: the other's wait times out and aborts; nobody hangs.
void missing_rank_case(launch how) {
  const ranks_run run(2, "missing_rank", how, 90s);
  INFO(run.describe());
  CHECK(run.all_ok());
  const std::vector<std::byte> e = run.get("missing_error");
  const auto waited = run.value<double>("missing_waited");
  const std::string what(reinterpret_cast<const char*>(e.data()), e.size());
  CAPTURE(what);
  CHECK(waited >= 2.5);
  CHECK(waited < 20.0);
  CHECK(contains(what, "all_reduce"));
  CHECK(contains(what, "aborted the NCCL communicator"));
}

}  // namespace

// Every case on processes first, then on threads (NCCL 2.30+): a thread launch that hangs until
// the test executable's own timeout then leaves the processes' results whole.
TEST_CASE("nccl ranks as processes: every collective against the host threads backend, and a split" *
          doctest::skip(!has_gpu)) {
  collectives_case(launch::processes);
}

TEST_CASE("nccl ranks as processes: shard_group matches the host backend (shardings, bf16, offload, frozen, hpZ)" *
          doctest::skip(!has_gpu)) {
  shard_group_case(launch::processes);
}

TEST_CASE("nccl ranks as processes: a step's hooks, opt.step() and zero_grad() make the host wait 0 times" * doctest::skip(!has_gpu)) {
  const ranks_run run(2, "host_waits");
  INFO(run.describe());
  REQUIRE(run.all_ok());
  for (int r = 0; r < 2; ++r) {
    const auto c = run.value<std::array<long, 9>>("host_waits_" + std::to_string(r));
    CAPTURE(r);
    MESSAGE("rank " << r << ": step without clipping: " << c[0] << " fsdp host waits, " << c[1] << " synchronizing CUDA calls, "
                    << c[2] << " cudaMalloc/cudaFree; clip_grad_norm: " << c[3] << ", " << c[4] << ", " << c[5]);
    CHECK(c[0] == 0);
    CHECK(c[1] == 0);
    CHECK(c[2] == 0);
    // Clipping returns the norm to the host: one wait, for that read (detail/cuda_norm.hpp; with
    // Thrust's reductions it was 2 per bucket + 2 = 8 on the H200, 2026-11-28).
    CHECK(c[3] + c[4] == 1);
    CHECK(c[5] == 0);
    // Clipped on the device (clip_on_device), the whole step makes none.
    MESSAGE("rank " << r << ": a step clipped by clip_on_device: " << c[6] << " fsdp host waits, " << c[7]
                    << " synchronizing CUDA calls, " << c[8] << " cudaMalloc/cudaFree");
    CHECK(c[6] == 0);
    CHECK(c[7] == 0);
    CHECK(c[8] == 0);
  }
}

TEST_CASE("nccl ranks as processes: a shard_group step captured as a CUDA graph and launched four times trains "
          "as four eager steps, bit for bit (SGD f32 and bf16, capturable AdamW bf16)" *
          doctest::skip(!has_gpu)) {
  graph_case(launch::processes);
}

TEST_CASE("nccl ranks as processes: a rank that never joins makes the other's wait time out and abort, nobody hangs" *
          doctest::skip(!has_gpu)) {
  missing_rank_case(launch::processes);
}

TEST_CASE("nccl ranks as threads (NCCL 2.30+): every collective against the host threads backend, and a split" *
          doctest::skip(!has_gpu || !nccl_threads)) {
  collectives_case(launch::threads);
}

TEST_CASE("nccl ranks as threads (NCCL 2.30+): shard_group matches the host backend (shardings, bf16, offload, "
          "frozen, hpZ)" *
          doctest::skip(!has_gpu || !nccl_threads)) {
  shard_group_case(launch::threads);
}

TEST_CASE("nccl ranks as threads (NCCL 2.30+): a shard_group step captured as a CUDA graph and launched four "
          "times trains as four eager steps, bit for bit (SGD f32 and bf16, capturable AdamW bf16)" *
          doctest::skip(!has_gpu || !nccl_threads)) {
  graph_case(launch::threads);
}

TEST_CASE("nccl ranks as threads (NCCL 2.30+): a rank that never joins makes the other's wait time out and "
          "abort, nobody hangs" *
          doctest::skip(!has_gpu || !nccl_threads)) {
  missing_rank_case(launch::threads);
}

TEST_CASE("nccl ranks as threads (NCCL 2.30+): a rank that throws ends its peer's wait at once, and the launcher rethrows "
          "its error" * doctest::skip(!has_gpu || !nccl_threads)) {
  const ranks_run run(2, "rank_fails", launch::threads);
  CHECK(run.failure == "rank 1 gives up on purpose");  // the root cause, not rank 0's peer failure
  const std::vector<std::byte> e = run.get("fails_error");
  const std::string what(reinterpret_cast<const char*>(e.data()), e.size());
  const auto waited = run.value<double>("fails_waited");
  CAPTURE(what);
  CHECK(contains(what, "peer failure: "));
  CHECK(contains(what, "rank 1 failed: rank 1 gives up on purpose"));
  CHECK(contains(what, "aborted the NCCL communicator"));
  CHECK(waited < 10.0);
}

// Last: new on the GPU (not yet run there), and a thread rank that fails on the device may leave
// an error that every later CUDA call of the process reports.
TEST_CASE("nccl ranks as processes: a group's buffers in NCCL's registered memory (ncclMemAlloc, ncclCommRegister) train "
          "as in fsdp's pool, bit for bit, eagerly and from a CUDA graph" * doctest::skip(!has_gpu)) {
  registered_case(launch::processes);
}

TEST_CASE("nccl ranks as threads (NCCL 2.30+): a group's buffers in NCCL's registered memory train as in fsdp's pool, "
          "bit for bit, eagerly and from a CUDA graph" * doctest::skip(!has_gpu || !nccl_threads)) {
  registered_case(launch::threads);
}
