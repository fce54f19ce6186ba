// Toolkit overhead: host time per unit per step that fsdp itself spends (hooks, scheduling,
// bookkeeping, queue hand-offs, and the collectives where there are any), with one 64-element
// parameter per unit so that compute and data movement are negligible. A step is what an
// engine does: zero_grad, forward scopes for every unit, backward scopes in reverse,
// finish_backward.
// Units are swept over 1, 4, ..., 1024 (`units:N` in the name).
//
//   overhead/ranks:1/params:f32                1 thread rank, full_precision<float>: the gathered
//                                              storage aliases the master shard (no gather, no
//                                              collective) and backward writes the gradient
//                                              shard (nothing queued)
//   overhead_forward_only/ranks:1/params:f32   forward scopes only (an evaluation pass) on that
//                                              group: nothing is queued, the hooks' bookkeeping
//   overhead/ranks:1/params:bf16               1 rank, mixed_precision<bf16, float, float>: a cast
//                                              (gather) task on the all-gather queue per bucket,
//                                              a cast and an accumulate on the reduce-scatter queue
//   overhead/ranks:2/params:f32                2 thread ranks, full_shard: real collectives (2
//                                              all-gathers + 1 reduce-scatter per bucket), and,
//                                              interleaved with it, the same collectives bare
//                                              (same sizes, backend, queues and order, one
//                                              reduction in flight, no shard_group): what any
//                                              FSDP on this backend pays
//   overhead/ranks:2/bare_vs_bare              the control of that row's ratio: the bare step
//                                              against a second bare step, interleaved alike
//   overhead_alone/ranks:2/params:f32 and       the 2-rank fsdp step and its bare collectives,
//   overhead_alone/ranks:2/bare                 each alone in its world (16 and 64 units)
//   optimizer_step/adamw/ranks:1/params:f32    adamw::step() + zero_grad() alone
//   queue_round_trip/on_wait                   a host_queue's fixed cost: enqueue an empty task,
//   queue_round_trip/on_enqueue                record an event, wait for it (on_wait: the waiter
//                                              runs the task; on_enqueue: the queue's thread
//                                              does, and the waiter learns of it)
//   flight_recorder/issue_and_marks            what the flight recorder adds to a collective:
//                                              its issue record, then the started and finished
//                                              marks around an empty task
//
// Counters (medians over the iterations): ns_per_unit, wall ns per unit per step on rank 0
// (what the engine waits when it has no compute for the queues to hide behind);
// cpu_ns_per_unit, CPU ns of rank 0's own thread per unit per step (what the hooks take from
// the engine's compute); units; for 2 ranks also bare_ns_per_unit and ratio = bare time / fsdp
// time. Flat counters across units mean the cost grows linearly with a constant per unit.
// Prefetch is the default (forward 1, backward 1) and buckets are per unit, as a user gets them.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <ctime>
#include <exception>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include <benchmark/benchmark.h>

#include <fsdp/fsdp.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

constexpr std::size_t param_numel = 64;  // one tiny parameter per unit

// Parameter handles with stable addresses (a shard_group keeps pointers to them).
template <class T>
struct tiny_model {
  explicit tiny_model(int units) {
    for (int u = 0; u < units; ++u) params.push_back(std::make_unique<fsdp::buffer<T>>(param_numel, "w"));
  }
  std::vector<std::unique_ptr<fsdp::buffer<T>>> params;
};

void fill_small(const fsdp::param_slice&, std::span<float> out) {
  for (float& x : out) x = 0.01f;
}

// One step of an engine without compute: the engine would read data() in forward and add
// into grad() in backward; one element each keeps the handles honest without costing time.
template <class Group, class T>
void engine_step(Group& g, tiny_model<T>& m) {
  const int units = static_cast<int>(m.params.size());
  g.zero_grad();  // as an engine's optimizer does every step: gradients restart from zero
  for (int u = 0; u < units; ++u) {
    auto in_use = g.forward(u);
    benchmark::DoNotOptimize(m.params[static_cast<std::size_t>(u)]->data()[0]);
  }
  for (int u = units; u-- > 0;) {
    auto in_use = g.backward(u);
    T& g0 = m.params[static_cast<std::size_t>(u)]->grad()[0];
    g0 = fsdp::convert<T>(fsdp::convert<float>(g0) + 1.0f);
  }
  g.finish_backward();
}

// CPU time of the calling thread: the engine's thread, whose time fsdp's hooks take from
// compute. Wall time also counts waiting for the queue threads, which compute would hide.
double thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

// What reading each clock adds to an interval it measures (the least of many back-to-back
// pairs); subtracted, so that a 200 ns step is not reported as 500 ns.
struct clock_costs {
  double wall_ns = 0, cpu_ns = 0;
};
clock_costs measure_clock_costs() {
  clock_costs c{1e9, 1e9};
  for (int i = 0; i < 64; ++i) {
    const auto t0 = clock_type::now();
    const auto t1 = clock_type::now();
    const double c0 = thread_cpu_ns();
    const double c1 = thread_cpu_ns();
    c.wall_ns = std::min(c.wall_ns, std::chrono::duration<double, std::nano>(t1 - t0).count());
    c.cpu_ns = std::min(c.cpu_ns, c1 - c0);
  }
  return c;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Stands for "no reference step" in run_world.
struct no_reference {};

// Runs a world of `ranks` thread ranks inside the benchmark. Rank 0 drives Google Benchmark's
// loop; the other ranks run exactly state.max_iterations iterations, the count that loop runs,
// so every rank issues the same collectives. Set-up and a first step (which records the unit
// order and checks it across ranks) are not timed. With a reference, each iteration also runs
// one reference step, alternating which goes first, and both are timed on rank 0.
template <class Setup, class Step, class Reference = no_reference>
void run_world(benchmark::State& state, int ranks, Setup setup, Step step, Reference reference = {}) {
  constexpr bool has_reference = !std::is_same_v<Reference, no_reference>;
  const int units = static_cast<int>(state.range(0));
  const benchmark::IterationCount iterations = state.max_iterations;
  std::vector<double> wall_ns, cpu_ns, reference_ns;  // rank 0's, per iteration
  const clock_costs clocks = measure_clock_costs();
  try {
    fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
      auto ctx = setup(comm, units);
      step(*ctx);
      const bool timing = comm.rank() == 0;
      auto one_iteration = [&](benchmark::IterationCount it) {
        auto timed_step = [&] {
          // The CPU clock is a system call; read it outside the wall-clock interval.
          const double c0 = thread_cpu_ns();
          const auto t0 = clock_type::now();
          step(*ctx);
          const auto t1 = clock_type::now();
          if (!timing) return;
          cpu_ns.push_back(std::max(0.0, thread_cpu_ns() - c0 - clocks.cpu_ns));
          wall_ns.push_back(std::max(0.0, std::chrono::duration<double, std::nano>(t1 - t0).count() - clocks.wall_ns));
        };
        if constexpr (has_reference) {
          auto timed_reference = [&] {
            const auto t0 = clock_type::now();
            reference(*ctx);
            const auto t1 = clock_type::now();
            if (timing) reference_ns.push_back(std::max(0.0, std::chrono::duration<double, std::nano>(t1 - t0).count() - clocks.wall_ns));
          };
          if (it % 2 == 0) {
            timed_step();
            timed_reference();
          } else {
            timed_reference();
            timed_step();
          }
        } else {
          timed_step();
        }
        return timing ? wall_ns.back() * 1e-9 : 0.0;
      };
      if (timing) {
        benchmark::IterationCount it = 0;
        for (auto _ : state) state.SetIterationTime(one_iteration(it++));
      } else {
        for (benchmark::IterationCount it = 0; it < iterations; ++it) one_iteration(it);
      }
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.counters["units"] = units;
  state.counters["ns_per_unit"] = median(wall_ns) / units;
  state.counters["cpu_ns_per_unit"] = median(cpu_ns) / units;
  if constexpr (has_reference) {
    const double bare = median(reference_ns);
    state.counters["bare_ns_per_unit"] = bare / units;
    state.counters["ratio"] = median(wall_ns) > 0 ? bare / median(wall_ns) : 0.0;
  }
}

template <class Group>
struct group_ctx {
  using param_t = typename Group::param_type;
  explicit group_ctx(fsdp::threads::communicator& comm, int units) : model(units), group(comm) {
    for (auto& p : model.params) group.add_unit({p.get()});
    group.finalize(fsdp::init::per_shard(fill_small));
  }
  tiny_model<param_t> model;  // before the group: handles outlive it
  Group group;
};

// Forward scopes only, as an evaluation pass runs them. With one f32 rank nothing is queued
// (the master is the gathered storage): this is the hooks' bookkeeping alone.
template <class Group>
void bm_forward_only(benchmark::State& state, int ranks) {
  run_world(
      state, ranks, [](fsdp::threads::communicator& comm, int units) { return std::make_unique<group_ctx<Group>>(comm, units); },
      [](group_ctx<Group>& c) {
        const int units = static_cast<int>(c.model.params.size());
        for (int u = 0; u < units; ++u) {
          auto in_use = c.group.forward(u);
          benchmark::DoNotOptimize(c.model.params[static_cast<std::size_t>(u)]->data()[0]);
        }
      });
}

// The collectives of one fsdp full_shard step, bare: per unit an all-gather in forward, an
// all-gather and a reduce-scatter in backward, of the same sizes fsdp uses for a 64-element
// parameter (padded to 128 elements on 2 ranks), on two queues, with one reduction in flight.
struct bare_ctx {
  bare_ctx(fsdp::threads::communicator& c, int u)
      : comm(c), units(u), shard(fsdp::padding_multiple(c.size()) / static_cast<std::size_t>(c.size())),
        full(shard * static_cast<std::size_t>(c.size())), grad(full.size()), out(shard) {}
  fsdp::threads::communicator& comm;
  int units;
  std::size_t shard;
  std::vector<float> full, grad, out;
  fsdp::host_queue ag{"all_gather"}, rs{"reduce_scatter"};
};

void bare_step(bare_ctx& c) {
  const auto t = c.comm.timeout();
  float* mine = c.full.data() + static_cast<std::size_t>(c.comm.rank()) * c.shard;
  for (int u = 0; u < c.units; ++u) c.comm.all_gather(mine, c.full.data(), c.shard, fsdp::dtype::f32, c.ag).wait(t);
  fsdp::host_event pending;
  for (int u = c.units; u-- > 0;) {
    c.comm.all_gather(mine, c.full.data(), c.shard, fsdp::dtype::f32, c.ag).wait(t);
    pending.wait(t);
    pending = c.comm.reduce_scatter(c.grad.data(), c.out.data(), c.shard, fsdp::dtype::f32, fsdp::reduce_op::avg, c.rs);
  }
  pending.wait(t);
}

template <class Group>
void bm_overhead(benchmark::State& state, int ranks) {
  run_world(
      state, ranks, [](fsdp::threads::communicator& comm, int units) { return std::make_unique<group_ctx<Group>>(comm, units); },
      [](group_ctx<Group>& c) { engine_step(c.group, c.model); });
}

// A group and the bare collectives of the same step, on the same communicator (collectives
// match by issue order, and every rank issues both in the same order).
template <class Group>
struct group_and_bare_ctx : group_ctx<Group> {
  group_and_bare_ctx(fsdp::threads::communicator& comm, int units) : group_ctx<Group>(comm, units), bare(comm, units) {}
  bare_ctx bare;
};

template <class Group>
void bm_overhead_vs_bare(benchmark::State& state, int ranks) {
  run_world(
      state, ranks,
      [](fsdp::threads::communicator& comm, int units) { return std::make_unique<group_and_bare_ctx<Group>>(comm, units); },
      [](group_and_bare_ctx<Group>& c) { engine_step(c.group, c.model); }, [](group_and_bare_ctx<Group>& c) { bare_step(c.bare); });
}

// The control of overhead/ranks:2's ratio: the bare step against a second bare step of its
// own (its own buffers and queues), interleaved the same way. Both sides do the same work, so
// its ratio's spread over the unit counts and runs is what this machine's scheduling alone does
// to that row's ratio of two equal steps.
struct two_bare_ctx {
  two_bare_ctx(fsdp::threads::communicator& comm, int units) : a(comm, units), b(comm, units) {}
  bare_ctx a, b;
};
void bm_bare_vs_bare(benchmark::State& state, int ranks) {
  run_world(
      state, ranks, [](fsdp::threads::communicator& comm, int units) { return std::make_unique<two_bare_ctx>(comm, units); },
      [](two_bare_ctx& c) { bare_step(c.a); }, [](two_bare_ctx& c) { bare_step(c.b); });
}

// The bare collectives alone in their world: beside overhead_alone/ranks:2/params:f32 (the fsdp
// step alone in its world), what overhead/ranks:2 interleaves in one world. Interleaved, each
// step's queue threads are idle (and spinning down) while the other's run, which slowed both
// there by up to 50 % at 16 units on 2026-11-27 (docs/benchmarks.md).
void bm_bare(benchmark::State& state, int ranks) {
  run_world(
      state, ranks, [](fsdp::threads::communicator& comm, int units) { return std::make_unique<bare_ctx>(comm, units); },
      [](bare_ctx& c) { bare_step(c); });
}

template <class Group>
struct optimizer_ctx : group_ctx<Group> {
  optimizer_ctx(fsdp::threads::communicator& comm, int units) : group_ctx<Group>(comm, units), opt(this->group, {}) {
    engine_step(this->group, this->model);  // the order check and a first reduction happen here
  }
  fsdp::adamw<Group> opt;
};

template <class Group>
void bm_optimizer_step(benchmark::State& state, int ranks) {
  run_world(
      state, ranks,
      [](fsdp::threads::communicator& comm, int units) { return std::make_unique<optimizer_ctx<Group>>(comm, units); },
      [](optimizer_ctx<Group>& c) {
        c.opt.step();
        c.opt.zero_grad();
      });
}

// One thread, no collective: what every collective issued and waited for pays to the queue.
void bm_queue_round_trip(benchmark::State& state, fsdp::queue_wake wake) {
  fsdp::host_queue q{"bench", wake};
  int runs = 0;
  for (auto _ : state) {
    q.enqueue([&runs] { ++runs; }, fsdp::run_on::queue_or_waiter);
    q.record().wait(std::chrono::seconds(10));
  }
  if (runs != static_cast<int>(state.iterations())) state.SkipWithError("a task did not run");
}

void bm_flight_recorder(benchmark::State& state) {
  fsdp::flight_recorder& rec = fsdp::flight_recorder::of(1 << 20);  // a world rank no benchmark uses
  const std::vector<int> members{1 << 20};
  const int stream = rec.open_stream(members);
  const fsdp::detail::collective c{fsdp::detail::collective_kind::all_gather, 16384, fsdp::dtype::f32};
  int runs = 0;
  for (auto _ : state) rec.issue(stream, c, 0, members).around([&runs] { ++runs; });
  benchmark::DoNotOptimize(runs);
}

using group_f32 = fsdp::shard_group<fsdp::buffer<float>>;
using group_bf16 = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>>;

// Host time (wall clock) of rank 0's fsdp step is the benchmark's time: the work spans the
// caller and the queue threads, and a reference step may run in the same iteration.
void sweep_units(benchmark::internal::Benchmark* b) {
  b->ArgName("units")->RangeMultiplier(4)->Range(1, 1024)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

// Two unit counts only: the sweep above has the shape; these compare two figures.
void alone_units(benchmark::internal::Benchmark* b) {
  b->ArgName("units")->Arg(16)->Arg(64)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

const bool registered = [] {
  sweep_units(benchmark::RegisterBenchmark("overhead/ranks:1/params:f32", bm_overhead<group_f32>, 1));
  sweep_units(benchmark::RegisterBenchmark("overhead_forward_only/ranks:1/params:f32", bm_forward_only<group_f32>, 1));
  sweep_units(benchmark::RegisterBenchmark("overhead/ranks:1/params:bf16", bm_overhead<group_bf16>, 1));
  sweep_units(benchmark::RegisterBenchmark("overhead/ranks:2/params:f32", bm_overhead_vs_bare<group_f32>, 2));
  sweep_units(benchmark::RegisterBenchmark("overhead/ranks:2/bare_vs_bare", bm_bare_vs_bare, 2));
  alone_units(benchmark::RegisterBenchmark("overhead_alone/ranks:2/params:f32", bm_overhead<group_f32>, 2));
  alone_units(benchmark::RegisterBenchmark("overhead_alone/ranks:2/bare", bm_bare, 2));
  sweep_units(benchmark::RegisterBenchmark("optimizer_step/adamw/ranks:1/params:f32", bm_optimizer_step<group_f32>, 1));
  benchmark::RegisterBenchmark("queue_round_trip/on_wait", bm_queue_round_trip, fsdp::queue_wake::on_wait);
  benchmark::RegisterBenchmark("queue_round_trip/on_enqueue", bm_queue_round_trip, fsdp::queue_wake::on_enqueue);
  benchmark::RegisterBenchmark("flight_recorder/issue_and_marks", bm_flight_recorder);
  return true;
}();

}  // namespace
