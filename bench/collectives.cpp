// Collectives of the threads backend against the raw cost of moving the same bytes, timed
// interleaved in the same benchmark run (the machine is shared and noisy: read the ratio).
//
//   collectives/threads/all_gather/ranks:R/bytes:B       B = gathered bytes (f32), in place
//                                                        as shard_group issues it
//   collectives/threads/reduce_scatter/ranks:R/bytes:B   B = each rank's input bytes (f32, sum)
//
// Each iteration runs, in rotating order, (a) fsdp: threads::communicator's collective
// issued on a host_queue and waited for, (b) raw: every rank memcpys the (R-1)/R of the
// buffer it lacks straight from its peers' buffers (all-gather), or sums its chunk of every
// rank's input in a plain float loop, in rank order (reduce-scatter), and (c) synced: raw
// between two barriers of the rank threads, the least any collective must add to it (each rank
// learns that its peers' inputs are ready, and before it returns that they are done reading
// its own). All start from a barrier of the rank threads, which are started once per
// measurement, as the queues are; a run's time is from the first rank leaving the barrier to
// the last rank finishing.
//
// Counters (medians over the iterations): fsdp_GBps and raw_GBps are bus bandwidth,
// bytes * (R-1)/R / time as nccl-tests reports it; ratio = raw time / fsdp time (1 means fsdp
// moves bytes as fast as memcpy; below 1 is its cost); bound = raw time / synced time, the
// best ratio a collective that synchronizes can reach on this machine; fsdp_us, raw_us,
// synced_us. The Time column is fsdp's (manual time, mean).

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include <fsdp/fsdp.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

enum class collective { all_gather, reduce_scatter };

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One rank's buffers. all_gather: `full` is the gathered buffer, this rank's shard is its slot
// (in place). reduce_scatter: `full` is the input, `out` this rank's chunk of the sum.
struct rank_buffers {
  rank_buffers(collective c, int rank, std::size_t count, int ranks)
      : full(count * static_cast<std::size_t>(ranks), 1.0f + static_cast<float>(rank)),
        out(c == collective::reduce_scatter ? count : 0) {}
  std::vector<float> full, out;
};

// The floor: the same bytes moved with no queue, no rendezvous and no checks.
void raw_op(collective c, int me, std::size_t count, const std::vector<rank_buffers*>& peers) {
  const auto n = peers.size();
  const auto mine = static_cast<std::size_t>(me);
  if (c == collective::all_gather) {
    float* dst = peers[mine]->full.data();
    for (std::size_t j = 0; j < n; ++j)
      if (j != mine) std::memcpy(dst + j * count, peers[j]->full.data() + j * count, count * sizeof(float));
    return;
  }
  float* out = peers[mine]->out.data();
  const float* first = peers[0]->full.data() + mine * count;
  std::copy(first, first + count, out);
  for (std::size_t j = 1; j < n; ++j) {
    const float* in = peers[j]->full.data() + mine * count;
    for (std::size_t i = 0; i < count; ++i) out[i] += in[i];
  }
}

// The cheapest barrier of threads: a count and a generation, spun on with yields (4 ranks
// outnumber this machine's 2 cores, so a rank that waits must let its peers run).
class spin_barrier {
 public:
  explicit spin_barrier(int n) : n_(n) {}
  void arrive_and_wait() {
    const unsigned generation = generation_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == generation) std::this_thread::yield();
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<unsigned> generation_{0};
};

void fsdp_op(collective c, fsdp::threads::communicator& comm, fsdp::host_queue& q, std::size_t count, rank_buffers& b) {
  const auto rank = static_cast<std::size_t>(comm.rank());
  if (c == collective::all_gather)
    comm.all_gather(b.full.data() + rank * count, b.full.data(), count, fsdp::dtype::f32, q).wait(comm.timeout());
  else
    comm.reduce_scatter(b.full.data(), b.out.data(), count, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(comm.timeout());
}

void bm_collective(benchmark::State& state, collective c, int ranks, fsdp::queue_wake wake) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t count = bytes / sizeof(float) / static_cast<std::size_t>(ranks);  // per-rank shard
  const benchmark::IterationCount iterations = state.max_iterations;
  std::barrier sync(ranks);
  spin_barrier fence(ranks);
  std::vector<rank_buffers*> peers(static_cast<std::size_t>(ranks));
  // [0] fsdp, [1] raw, [2] synced: when each rank started and finished the current iteration's run.
  constexpr int variants = 3;
  std::array<std::vector<clock_type::time_point>, variants> start, end;
  for (auto* v : {&start, &end})
    for (auto& t : *v) t.resize(static_cast<std::size_t>(ranks));
  std::array<std::vector<double>, variants> seconds;  // per iteration, filled by rank 0

  try {
    fsdp::threads::world{ranks}.run([&](fsdp::threads::communicator& comm) {
      const int me = comm.rank();
      const auto r = static_cast<std::size_t>(me);
      fsdp::host_queue q{"collectives", wake};
      rank_buffers b(c, me, count, ranks);
      peers[r] = &b;
      sync.arrive_and_wait();  // every rank's buffers are published
      fsdp_op(c, comm, q, count, b);  // warm-up: first touch, queue thread awake
      auto one_iteration = [&](benchmark::IterationCount it) {
        for (int k = 0; k < variants; ++k) {
          const int which = (k + static_cast<int>(it % variants)) % variants;  // rotate which runs first
          sync.arrive_and_wait();
          start[static_cast<std::size_t>(which)][r] = clock_type::now();
          if (which == 0) {
            fsdp_op(c, comm, q, count, b);
          } else if (which == 1) {
            raw_op(c, me, count, peers);
          } else {
            fence.arrive_and_wait();  // the peers' inputs are ready
            raw_op(c, me, count, peers);
            fence.arrive_and_wait();  // and done with: this rank's may be reused
          }
          end[static_cast<std::size_t>(which)][r] = clock_type::now();
        }
        sync.arrive_and_wait();  // every rank's times are written
        if (me != 0) return 0.0;
        for (std::size_t w = 0; w < variants; ++w) {
          const auto first = *std::min_element(start[w].begin(), start[w].end());
          const auto last = *std::max_element(end[w].begin(), end[w].end());
          seconds[w].push_back(std::chrono::duration<double>(last - first).count());
        }
        return seconds[0].back();
      };
      if (me == 0) {
        benchmark::IterationCount it = 0;
        for (auto _ : state) state.SetIterationTime(one_iteration(it++));
      } else {
        for (benchmark::IterationCount it = 0; it < iterations; ++it) one_iteration(it);
      }
      sync.arrive_and_wait();  // no rank frees its buffers while a peer may still read them
    });
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }

  const double t_fsdp = median(seconds[0]), t_raw = median(seconds[1]), t_synced = median(seconds[2]);
  const double bus = static_cast<double>(count * static_cast<std::size_t>(ranks) * sizeof(float)) * (ranks - 1) / ranks;
  state.counters["ranks"] = ranks;
  state.counters["fsdp_us"] = t_fsdp * 1e6;
  state.counters["raw_us"] = t_raw * 1e6;
  state.counters["fsdp_GBps"] = t_fsdp > 0 ? bus / t_fsdp / 1e9 : 0.0;
  state.counters["raw_GBps"] = t_raw > 0 ? bus / t_raw / 1e9 : 0.0;
  state.counters["ratio"] = t_fsdp > 0 ? t_raw / t_fsdp : 0.0;
  state.counters["synced_us"] = t_synced * 1e6;
  state.counters["bound"] = t_synced > 0 ? t_raw / t_synced : 0.0;
}

const bool registered = [] {
  for (fsdp::queue_wake wake : {fsdp::queue_wake::on_enqueue, fsdp::queue_wake::on_wait})
    for (collective c : {collective::all_gather, collective::reduce_scatter})
      for (int ranks : {2, 4}) {
        const std::string name = std::string(wake == fsdp::queue_wake::on_wait ? "collectives_waited" : "collectives") +
                                 "/threads/" + (c == collective::all_gather ? "all_gather" : "reduce_scatter") +
                                 "/ranks:" + std::to_string(ranks);
        benchmark::RegisterBenchmark(name.c_str(), bm_collective, c, ranks, wake)
            ->ArgName("bytes")
            ->Arg(64 << 10)
            ->Arg(1 << 20)
            ->Arg(16 << 20)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
  return true;
}();

}  // namespace
