#pragma once
// examples/common/nccl_thread_ranks.hpp: N NCCL ranks as N threads of this process, all on one
// GPU (train_gpt --device cuda --backend nccl --nccl-ranks threads, tests/cuda/test_nccl_ranks).
//
// NCCL 2.30 lets ranks of one communicator share a GPU when NCCL_MULTI_RANK_GPU_ENABLE=1 (its
// env docs: experimental; "the application must still arrange for ranks to share a device").
// Threads of one process, where common/process_ranks.hpp starts processes: one process is one CUDA
// context, so one rank's NCCL kernel runs beside its peers' (they spin on each other) and beside
// their compute, where processes without MPS take turns on the GPU; and the ranks connect through
// NCCL's peer-to-peer transport on the device, not through sockets. With NCCL 2.28 (older
// lent machines) only the processes with their own NCCL_HOSTID run: this launcher refuses by name.
//
//   example::run_nccl_thread_ranks({.ranks = 4}, [&](fsdp::nccl::communicator& comm, const fsdp::cuda_device& gpu,
//                                                    const std::function<void()>& meet) { ... });
//
// Each rank allocates its own NCCL channels, one thread block each, and a kernel of a collective
// needs its peers' blocks resident beside its own: NCCL's docs say its defaults fit two ranks on a
// GPU and advise capping the channels (NCCL_MAX_CTAS). A shard_group rank runs two collectives at
// once (its all-gather and reduce-scatter streams), so the launcher caps each rank's blocks at
// 32 / ranks, rounded down to a power of two: two ranks' worth of ncclConfig_t::maxCTAs's
// documented default, 32, shared out over ranks x 2 streams (a power of two because NCCL rounds
// its send/recv channels up to one: 21 would give 32). Set per communicator (its splits inherit
// it), where NCCL reads NCCL_MAX_CTAS once a process; four ranks then spin on at most 64 of an
// H100's 132 SMs. NCCL_MAX_CTAS, where set, overrides it.
//
// One CUDA context also means that a call which waits for the whole device (cudaFreeHost, a
// lazily loaded kernel's first launch, cudaDeviceSynchronize) on one rank waits for the peers'
// NCCL kernels, which wait for that rank: a deadlock until the communicators' timeout. The
// launcher asks for CUDA_MODULE_LOADING=EAGER; a rank's work must not allocate or free pinned
// host memory while its peers may be inside a collective (meet on the host first).
//
// Failures as threads::world reports them: once a rank throws, every other rank's next wait on
// its communicator aborts it (nccl::communicator::watch_peers) and throws a peer failure naming
// the first; the launcher joins every rank and rethrows the root cause. A rank that never
// reaches a collective holds the others up to the communicators' timeout, never longer.

#include <nccl.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/comm/nccl.hpp>
#include <fsdp/core/error.hpp>
#include <fsdp/device/cuda.hpp>

#include "common/host_meeting.hpp"

namespace example {

//! The NCCL library's version as NCCL numbers it (2.30.7: 23007), asked of the library loaded,
//! not of the header compiled against.
inline int nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) throw fsdp::error(fsdp::errc::internal, "ncclGetVersion failed");
  return v;
}

//! "2.30.7" for 23007.
inline std::string nccl_version_string(int v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

struct nccl_thread_options {
  int ranks = 2;
  int device = 0;  //!< every rank's GPU
  std::chrono::milliseconds timeout = fsdp::default_timeout();  //!< each communicator's
};

//! Runs fn(comm, gpu, meet) on o.ranks threads, rank r's communicator of o.ranks ranks on GPU
//! o.device, where meet() returns once every rank called it as often (a barrier on the host, for
//! ranks about to do what waits for the whole device; it throws errc::peer_failure once a rank
//! failed, errc::timeout after o.timeout); returns when every rank has returned, and rethrows the
//! first failure (the root cause, not the peer failures it caused). Throws fsdp::error(errc::invalid_argument) before
//! starting any rank when the loaded NCCL is older than 2.30, NCCL_MULTI_RANK_GPU_ENABLE is set
//! to anything but 1, or CUDA loads its kernels lazily (CUDA_MODULE_LOADING is not EAGER).
template <class F>
void run_nccl_thread_ranks(const nccl_thread_options& o, F&& fn) {
  if (o.ranks < 1) throw fsdp::error(fsdp::errc::invalid_argument, "NCCL thread ranks: ranks must be >= 1, got " + std::to_string(o.ranks));
  if (o.ranks > 1) {
    if (const int v = nccl_version(); v < 23000)
      throw fsdp::error(fsdp::errc::invalid_argument,
                        "NCCL " + nccl_version_string(v) + " refuses ranks of one communicator that share a GPU on one host; " + std::to_string(o.ranks) +
                            " thread ranks on one GPU need NCCL 2.30 or later (NCCL_MULTI_RANK_GPU_ENABLE). With this NCCL run "
                            "the ranks as processes, each with its own NCCL_HOSTID (train_gpt: --nccl-ranks processes)");
    // CUDA's lazy loading may make a kernel's first launch wait for the context's running
    // kernels (CUDA's programming guide, "Lazy Loading": kernels that rely on running
    // concurrently can deadlock); here one rank's NCCL kernel spins until its peers' join it, and
    // a peer blocked in loading a kernel never does. CUDA reads the variable when it starts, so
    // it is checked, not set.
    if (const char* load = std::getenv("CUDA_MODULE_LOADING"); load == nullptr || std::string(load) != "EAGER")
      throw fsdp::error(fsdp::errc::invalid_argument,
                        "NCCL thread ranks spin on each other's kernels in one CUDA context, where a kernel loaded lazily "
                        "at its first launch may wait for them: run with CUDA_MODULE_LOADING=EAGER (set before CUDA starts; it is " +
                            std::string(load ? std::string("'") + load + "'" : "unset, so lazy") + ")");
    // Before any communicator of this process exists: NCCL reads its settings once.
    setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
    if (const std::string set = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE"); set != "1")
      throw fsdp::error(fsdp::errc::invalid_argument, "NCCL thread ranks share one GPU, which NCCL allows only with "
                                                      "NCCL_MULTI_RANK_GPU_ENABLE=1; it is set to '" + set + "'");
  }
  const fsdp::nccl::unique_id id = fsdp::nccl::make_unique_id();
  // Each rank's thread blocks (above): 32 ranks or more get one each.
  const int max_ctas = o.ranks > 1 ? static_cast<int>(std::bit_floor(32u / static_cast<unsigned>(std::min(o.ranks, 32)))) : 0;
  host_meeting meeting{o.ranks, o.timeout};  // the first failure, and meet()
  const std::function<void()> meet = [&] { meeting.meet(); };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(o.ranks));
  for (int r = 0; r < o.ranks; ++r) {
    auto rank = [&, r] {
      try {
        const fsdp::cuda_device gpu{o.device};
        fsdp::nccl::communicator comm(gpu, r, o.ranks, id, o.timeout, max_ctas);
        comm.watch_peers([&] { return meeting.reason(); });
        try {
          fn(comm, gpu, meet);
        } catch (...) {
          // Told at once, and aborted, not finalized: the peers must not wait for this rank's
          // communicator and device to be torn down (a finalize waits for them up to its timeout).
          meeting.fail(r, std::current_exception());
          comm.abort("this rank failed");
        }
      } catch (...) {
        meeting.fail(r, std::current_exception());
      }
    };
    try {
      threads.emplace_back(rank);
    } catch (const std::exception& e) {
      // No thread for rank r: the ranks running stop at their next wait (or their communicator's
      // timeout, if still joining), and are joined, never left joinable.
      meeting.fail(r, std::make_exception_ptr(fsdp::error(fsdp::errc::invalid_argument, "NCCL thread ranks: could not start the thread of rank " +
                                                                                            std::to_string(r) + " (" + e.what() + ")")));
      break;
    }
  }
  for (std::thread& t : threads) t.join();
  meeting.rethrow_first();
}

}  // namespace example
