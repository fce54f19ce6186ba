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
#include <string>

#include <fsdp/comm/threads.hpp>

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
};

//! Calls started(ranks, "thread ranks" | "MPI processes") once, on rank 0, then rank_main(comm)
//! on every rank: on o.ranks threads of this process, or, for "mpi", in this process with the
//! communicator of every process (MPI is initialised here and finalised on return; argc and
//! argv are MPI_Init's). Exceptions leave through the call (from any thread rank); under MPI a
//! rank's exception is printed first ("<argv[0]>: rank r: <what>") and every other rank told
//! (environment::abort), since the job then ends with MPI_Abort.
template <class Started, class RankMain>
void launch([[maybe_unused]] int& argc, [[maybe_unused]] char**& argv, const launch_options& o, Started&& started,
            RankMain&& rank_main) {
#if FSDP_EXAMPLE_MPI
  if (o.backend == "mpi") {
    fsdp::mpi::environment env(argc, argv);
    int ranks = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    if (env.rank() == 0) started(ranks, "MPI processes");
    try {
      auto comm = env.world();
      rank_main(comm);
    } catch (const std::exception& e) {
      // Printed here: once a rank has failed, env's destructor ends the job with MPI_Abort, which
      // may kill this process before the program's own handler runs. The peers are told too.
      std::fprintf(stderr, "%s: rank %d: %s\n", argv[0], env.rank(), e.what());
      std::fflush(stderr);
      env.abort(e.what());
      throw;
    }
    return;
  }
#endif
  started(o.ranks, "thread ranks");
  fsdp::threads::world{o.ranks, o.world}.run([&](fsdp::threads::communicator& comm) { rank_main(comm); });
}

}  // namespace example
