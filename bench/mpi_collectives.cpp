// mpi_collectives: throughput of fsdp's mpi backend against plain MPI calls of the same sizes,
// measured in the same run, interleaved (the machine is shared and noisy: compare ratios).
//
//   mpiexec -n 4 build/release/bench/mpi_collectives [--reps 15]
//
// For each size (64 KiB, 1 MiB, 16 MiB gathered, f32) it times, per repetition,
// fsdp::mpi::communicator::all_gather (and reduce_scatter, sum) issued on a host_queue and
// waited for, and the blocking MPI_Allgather (and MPI_Reduce_scatter_block) on the same
// buffers, alternating which goes first. It reports the median over the repetitions of the
// slowest rank's time, the bus bandwidth (bytes * (n - 1) / n / time, as nccl-tests does) and
// ratio = raw time / fsdp time. Rows ending in .w: the same fsdp calls issued on a
// queue_wake::on_wait queue, where the waiting thread runs the collective's task itself; all
// repetitions on the default queue run first, then all on the on_wait queue. Row
// MPI_Iallgather: MPI's own nonblocking all-gather (MPI_Iallgather + MPI_Wait) in fsdp's place,
// timed after each default-queue pair: its ratio is the best a collective that does not block
// its caller (as fsdp's must not, to overlap) can reach against the blocking call.
//
// A plain program with a fixed repetition count, not Google Benchmark: under mpiexec every
// process would choose its own adaptive iteration count, and the processes' collectives would
// stop matching.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fsdp/comm/mpi.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times one call on every rank (a barrier first, so all start together) and returns the
// slowest rank's time: a collective is done when its last rank is.
template <class F>
double timed(MPI_Comm c, F f) {
  MPI_Barrier(c);
  const auto t0 = clock_type::now();
  f();
  double s = std::chrono::duration<double>(clock_type::now() - t0).count(), worst = 0;
  MPI_Allreduce(&s, &worst, 1, MPI_DOUBLE, MPI_MAX, c);
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::mpi::environment env(argc, argv);
  int reps = 20;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--reps") reps = std::max(3, std::atoi(argv[i + 1]));
  auto comm = env.world();
  const int n = comm.size(), r = comm.rank();
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  fsdp::host_queue q, q_waited{"waited", fsdp::queue_wake::on_wait};
  if (r == 0) {
    std::printf("mpi_collectives: %d processes, %d repetitions per size, median times, f32\n", n, reps);
    std::printf("%-15s %12s %10s %10s %10s %10s %8s\n", "collective", "bytes", "fsdp ms", "raw ms", "fsdp GB/s", "raw GB/s",
                "ratio");
  }
  for (std::size_t bytes : {std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{16} << 20}) {
    const std::size_t count = bytes / sizeof(float) / static_cast<std::size_t>(n);  // per-rank shard
    std::vector<float> shard(count, 1.0f + static_cast<float>(r)), full(count * static_cast<std::size_t>(n)), out(count);
    // [0] the default queue, [1] the on_wait queue (the waiting thread runs the collective's task).
    struct series {
      std::vector<double> ag, ag_raw, rs, rs_raw, ag_nonblocking;
    } times[2];
    // One queue mode after the other, not alternated within a repetition: right after a
    // collective on the default queue, that queue's thread still spins for its next task
    // (detail::spin_then_wait) and takes a core from the calls timed next.
    for (int w = 0; w < 2; ++w) {
      for (int k = -1; k < reps; ++k) {  // k = -1 warms up (first touch, shared-memory set-up); not kept
        // Alternate which of each pair runs first, so that neither always meets the other's caches.
        const bool fsdp_first = k % 2 == 0;
        auto pair = [&](auto& fsdp_call, auto& raw_call) {
          if (fsdp_first) {
            const double f = timed(raw, fsdp_call);
            return std::pair{f, timed(raw, raw_call)};
          }
          const double raw_s = timed(raw, raw_call);
          return std::pair{timed(raw, fsdp_call), raw_s};
        };
        fsdp::host_queue& on = w ? q_waited : q;
        auto agf = [&] { comm.all_gather(shard.data(), full.data(), count, fsdp::dtype::f32, on).wait(comm.timeout()); };
        auto agr = [&] {
          MPI_Allgather(shard.data(), static_cast<int>(count), MPI_FLOAT, full.data(), static_cast<int>(count), MPI_FLOAT, raw);
        };
        auto rsf = [&] {
          comm.reduce_scatter(full.data(), out.data(), count, fsdp::dtype::f32, fsdp::reduce_op::sum, on).wait(comm.timeout());
        };
        auto rsr = [&] { MPI_Reduce_scatter_block(full.data(), out.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw); };
        // The floor of a collective that must not block its caller (fsdp's overlap needs that):
        // MPI's own nonblocking all-gather, waited for at once.
        auto agnb = [&] {
          MPI_Request req = MPI_REQUEST_NULL;
          MPI_Iallgather(shard.data(), static_cast<int>(count), MPI_FLOAT, full.data(), static_cast<int>(count), MPI_FLOAT, raw, &req);
          MPI_Wait(&req, MPI_STATUS_IGNORE);
        };
        const auto [t_agf, t_agr] = pair(agf, agr);
        const auto [t_rsf, t_rsr] = pair(rsf, rsr);
        const double t_nb = w == 0 ? timed(raw, agnb) : 0.0;
        if (k < 0) continue;
        series& t = times[w];
        t.ag.push_back(t_agf);
        t.ag_raw.push_back(t_agr);
        t.rs.push_back(t_rsf);
        t.rs_raw.push_back(t_rsr);
        if (w == 0) t.ag_nonblocking.push_back(t_nb);
      }
    }
    if (r == 0) {
      const double bus = static_cast<double>(count * sizeof(float) * static_cast<std::size_t>(n)) * (n - 1) / n;
      auto row = [&](const char* name, const std::vector<double>& a, const std::vector<double>& b) {
        const double ta = median(a), tb = median(b);
        std::printf("%-15s %12zu %10.3f %10.3f %10.2f %10.2f %8.2f\n", name, count * sizeof(float) * static_cast<std::size_t>(n),
                    ta * 1e3, tb * 1e3, bus / ta / 1e9, bus / tb / 1e9, tb / ta);
      };
      row("all_gather", times[0].ag, times[0].ag_raw);
      row("reduce_scatter", times[0].rs, times[0].rs_raw);
      row("all_gather.w", times[1].ag, times[1].ag_raw);
      row("reduce_scatter.w", times[1].rs, times[1].rs_raw);
      row("MPI_Iallgather", times[0].ag_nonblocking, times[0].ag_raw);
    }
  }
  if (r == 0)
    std::printf("ratio = raw time / fsdp time (above 1: fsdp faster); .w: fsdp issued on a queue_wake::on_wait queue;\n"
                "MPI_Iallgather: MPI's nonblocking all-gather in fsdp's place, waited for at once (the floor of a\n"
                "collective that does not block its caller)\n");

  // A late peer: the engine of a rank that has waited 300 ms without a completion polls every
  // 1 ms instead of every 20 us (detail::backoff::mpi_progress()). What that costs the collective
  // once the late rank arrives: the late rank's time for a 16 MiB all_gather and reduce_scatter,
  // with every other rank waiting 300 ms for it (long phase) against 0 ms (pairs interleaved).
  {
    const std::size_t count = (std::size_t{16} << 20) / sizeof(float) / static_cast<std::size_t>(n);
    std::vector<float> shard(count, 1.0f), full(count * static_cast<std::size_t>(n), 1.0f), out(count);
    std::vector<double> on_time, late;
    for (int k = -1; k < reps; ++k) {
      for (int skew_ms : {0, 300}) {
        MPI_Barrier(raw);
        if (r == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(skew_ms));
        const auto t0 = clock_type::now();
        comm.all_gather(shard.data(), full.data(), count, fsdp::dtype::f32, q).wait(comm.timeout());
        comm.reduce_scatter(full.data(), out.data(), count, fsdp::dtype::f32, fsdp::reduce_op::sum, q).wait(comm.timeout());
        const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
        if (k >= 0) (skew_ms ? late : on_time).push_back(s);
      }
    }
    if (r == n - 1)
      std::printf("late peer, 16 MiB all_gather + reduce_scatter, the last rank's time: %.3f ms when all arrive together, "
                  "%.3f ms when the others waited 300 ms (ratio %.2f)\n",
                  median(on_time) * 1e3, median(late) * 1e3, median(late) / median(on_time));
  }
  return 0;
}
