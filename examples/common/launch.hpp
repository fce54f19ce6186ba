#pragma once
// examples/common/launch.hpp: runs one function on every rank of the backend the command line
// chose: N thread ranks in this process (fsdp::threads), or this process as one rank of an MPI
// job that mpiexec started (fsdp::mpi, in builds with FSDP_EXAMPLE_MPI).
//
//   example::launch(argc, argv, {.backend = "threads", .ranks = 4},
//                   [](int ranks, const char* kind) { std::printf("%d %s\n", ranks, kind); },  // rank 0, once
//                   [&](auto& comm) { train_rank(comm); });  // every rank, with its communicator
//
// The rank function is generic: it is instantiated for fsdp::threads::communicator and, with
// MPI, fsdp::mpi::communicator, so that it can pick its shard_group type from decltype(comm).

#include <cstdio>
#include <exception>
#include <numeric>
#include <regex>
#include <string>
#include <vector>

#include <fsdp/comm/threads.hpp>

#include "flight_dump.hpp"
#include "rank_log.hpp"

#ifndef FSDP_EXAMPLE_MPI
#define FSDP_EXAMPLE_MPI 0
#endif
#if FSDP_EXAMPLE_MPI
#include <fsdp/comm/mpi.hpp>
#endif

namespace example {

//! Whether this build has the mpi backend.
inline constexpr bool have_mpi = FSDP_EXAMPLE_MPI != 0;

struct launch_options {
  std::string backend = "threads";          //!< threads | mpi (run under mpiexec)
  int ranks = 4;                            //!< thread ranks (with mpi: mpiexec's -n instead)
  fsdp::threads::world_options world = {};  //!< threads: the wait timeout, a modelled link
  std::string log_dir = {};                 //!< per-rank logs DIR/rank_<r>.log (rank_log.hpp); empty: none
};

//! Where to look after a failure: every rank's log, and the log of the rank a message names as
//! failed ("rank 2 failed: ..."), if any. Empty without a log directory.
inline std::string where_the_logs_are(const std::string& log_dir, const std::string& what) {
  if (log_dir.empty()) return "";
  std::string out = "every rank's log is in " + log_dir + " (rank_<r>.log)";
  std::smatch m;
  if (std::regex_search(what, m, std::regex("rank ([0-9]+) failed")))
    out += "; rank " + m[1].str() + " failed first: " + rank_log_path(log_dir, std::stoi(m[1].str()));
  return out;
}

//! Calls started(ranks, "thread ranks" | "MPI processes") once, on rank 0, then rank_main(comm)
//! on every rank: on o.ranks threads of this process, or, for "mpi", in this process with the
//! communicator of every process (MPI is initialised here and finalised on return; argc and
//! argv are MPI_Init's). Exceptions leave through the call (from any thread rank); under MPI a
//! rank's exception is printed first ("<argv[0]>: rank r: <what>") and every other rank told
//! (environment::abort), since the job then ends with MPI_Abort. With o.log_dir, each rank's
//! lines also go to its log (rank_log.hpp) and a failing rank says where the logs are. A failing
//! rank writes its flight record, and SIGUSR1 every rank's (flight_dump.hpp).
template <class Started, class RankMain>
void launch([[maybe_unused]] int& argc, [[maybe_unused]] char**& argv, const launch_options& o, Started&& started,
            RankMain&& rank_main) {
#if FSDP_EXAMPLE_MPI
  if (o.backend == "mpi") {
    fsdp::mpi::environment env(argc, argv);
    if (!o.log_dir.empty()) tee_to_rank_log(o.log_dir, env.rank());
    int ranks = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    if (env.rank() == 0) started(ranks, "MPI processes");
    const flight_dump_on_usr1 usr1(o.log_dir, {env.rank()}, ranks);
    try {
      auto comm = env.world();
      rank_main(comm);
    } catch (const std::exception& e) {
      // Printed here: once a rank has failed, env's destructor ends the job with MPI_Abort, which
      // may kill this process before the program's own handler runs. The peers are told too.
      std::fprintf(stderr, "%s: rank %d: %s\n", argv[0], env.rank(), e.what());
      if (!o.log_dir.empty()) std::fprintf(stderr, "%s: rank %d: %s\n", argv[0], env.rank(), where_the_logs_are(o.log_dir, e.what()).c_str());
      dump_flight_records(o.log_dir, {env.rank()}, ranks, "after its failure");
      env.abort(e.what());
      throw;
    }
    return;
  }
#endif
  // Thread ranks share the process: rank 0's log has what the process prints (only rank 0
  // prints), each rank's log its own failure.
  if (!o.log_dir.empty()) {
    tee_to_rank_log(o.log_dir, 0);
    for (int r = 1; r < o.ranks; ++r) create_rank_log(o.log_dir, r);
  }
  started(o.ranks, "thread ranks");
  std::vector<int> all(static_cast<std::size_t>(o.ranks));
  std::iota(all.begin(), all.end(), 0);
  const flight_dump_on_usr1 usr1(o.log_dir, all, o.ranks);
  try {
    fsdp::threads::world{o.ranks, o.world}.run([&](fsdp::threads::communicator& comm) {
      try {
        rank_main(comm);
      } catch (const std::exception& e) {
        if (!o.log_dir.empty()) append_rank_log(o.log_dir, comm.rank(), "rank " + std::to_string(comm.rank()) + ": " + e.what());
        dump_flight_records(o.log_dir, {comm.rank()}, comm.size(), "after its failure");
        throw;
      }
    });
  } catch (const std::exception& e) {
    if (!o.log_dir.empty()) std::fprintf(stderr, "%s: %s\n", argv[0], where_the_logs_are(o.log_dir, e.what()).c_str());
    throw;
  }
}

}  // namespace example
