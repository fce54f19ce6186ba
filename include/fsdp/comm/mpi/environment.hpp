#pragma once
//! \file MPI for the lifetime of an object: mpi::environment initialises MPI, finds each
//! process's host, starts the engine (comm/mpi/engine.hpp) and makes the world communicator;
//! it ends MPI with MPI_Finalize, or with MPI_Abort after a failure (comm/mpi.hpp).

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/comm/mpi/communicator.hpp"
#include "fsdp/comm/mpi/datatypes.hpp"
#include "fsdp/comm/mpi/engine.hpp"
#include "fsdp/comm/topology.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::mpi {

//! MPI for the lifetime of the object: MPI_Init_thread with MPI_THREAD_MULTIPLE (the engine
//! thread polls while other threads make local calls), the bf16/f16 types, and the engine. The destructor ends MPI
//! with MPI_Finalize, or with MPI_Abort when a collective was left stuck (see the file comment).
class environment {
 public:
  //! `peers`: how a dead peer is found (comm/mpi/heartbeats.hpp; the defaults name it within
  //! about 11 s and never take a process stopped for 8 s for dead).
  environment(int& argc, char**& argv, liveness peers = {}) {
    int provided = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      throw error(errc::internal, "MPI_Init_thread failed");
    if (provided < MPI_THREAD_MULTIPLE) {
      MPI_Finalize();
      throw error(errc::internal, "this MPI provides thread level " + std::to_string(provided) +
                                      "; fsdp's mpi backend needs MPI_THREAD_MULTIPLE");
    }
    auto& h = detail::halves();
    MPI_Type_contiguous(2, MPI_BYTE, &h.bf16);
    MPI_Type_commit(&h.bf16);
    MPI_Type_contiguous(2, MPI_BYTE, &h.f16);
    MPI_Type_commit(&h.f16);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    world_hosts_ = std::make_shared<const std::vector<int>>(find_hosts());
    MPI_Comm failures = MPI_COMM_NULL, beats = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &failures);
    MPI_Comm_set_errhandler(failures, MPI_ERRORS_RETURN);
    MPI_Comm_dup(MPI_COMM_WORLD, &beats);
    MPI_Comm_set_errhandler(beats, MPI_ERRORS_RETURN);
    engine_ = std::make_unique<detail::engine>(world_rank_, failures, beats, peers);
  }
  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;
  ~environment() {
    const bool broken = engine_->broken();
    const std::string why = engine_->broken_reason();
    engine_.reset();  // joins the engine thread
    if (broken) {
      // The cause first: MPI_Abort may end this process before anything else is printed.
      std::fprintf(stderr, "fsdp: rank %d: ending the job with MPI_Abort after: %s\n", world_rank_, why.c_str());
      std::fflush(stderr);
      // Every broken rank waits 1 s before MPI_Abort makes mpiexec kill the others. The rank
      // whose failure the others were told of, so that their reports (out within milliseconds)
      // are printed; a rank that was told, so that the failing rank's own report gets out first:
      // a shard_group left by an exception tells the peers while the exception is still on its
      // way to the handler that prints it (the root cause; CI lost it once without this wait).
      std::this_thread::sleep_for(std::chrono::seconds(1));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Finalize();
  }

  //! What communicator::abort() does, for a failure outside any communicator's use (the
  //! program's own error handler): every rank's collectives end with errc::peer_failure.
  void abort(const std::string& why) { engine_->abort(why); }

  //! A communicator over every process (a duplicate of MPI_COMM_WORLD, errors returned, not
  //! fatal). Every wait on it is bounded by `timeout`.
  communicator world(milliseconds timeout = default_timeout()) {
    // On the engine thread, like every MPI call after MPI_Init: an MPI_Comm_dup here, beside the
    // engine's polling, raced inside Open MPI (ThreadSanitizer, mca_pml_ob1_add_comm).
    // The polled barrier first (as in communicator::split): a blocking MPI_Comm_dup that waits
    // for a late rank would stop this process's heartbeats.
    detail::op ready;
    ready.seq = engine_->reserve(1);
    ready.what = "barrier before comm_dup #" + std::to_string(ready.seq);
    ready.start = [](MPI_Request* r) { return MPI_Ibarrier(MPI_COMM_WORLD, r); };
    ready.timeout = timeout;
    const std::string ready_what = ready.what;
    engine_->run(std::move(ready), timeout * 2 + milliseconds(1000), ready_what);
    MPI_Comm c = MPI_COMM_NULL;
    std::vector<int> members;
    detail::op o;
    o.seq = engine_->reserve(1);
    o.what = "comm_dup #" + std::to_string(o.seq);
    o.start = [&c, &members](MPI_Request*) {
      const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c);
      if (rc == MPI_SUCCESS) {
        MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
        members = communicator::world_ranks_of(c);
      }
      return rc;
    };
    o.timeout = timeout;
    const std::string what = o.what;
    engine_->run(std::move(o), timeout * 2 + milliseconds(1000), what);
    return communicator(engine_.get(), c, timeout, world_hosts_, members);
  }

  int rank() const noexcept { return world_rank_; }
  //! The host of every process (hosts() of the world communicator).
  std::span<const int> hosts() const noexcept { return *world_hosts_; }

 private:
  //! Collective, before the engine starts: each process's host, keyed by the lowest world rank
  //! that shares its memory (MPI_COMM_TYPE_SHARED), gathered from every process.
  std::vector<int> find_hosts() {
    MPI_Comm node = MPI_COMM_NULL;
    int key = world_rank_, size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
      MPI_Allreduce(&world_rank_, &key, 1, MPI_INT, MPI_MIN, node);
      MPI_Comm_free(&node);
    }
    std::vector<int> keys(static_cast<std::size_t>(size));
    MPI_Allgather(&key, 1, MPI_INT, keys.data(), 1, MPI_INT, MPI_COMM_WORLD);
    return fsdp::detail::renumber_hosts(keys);
  }

  int world_rank_ = 0;
  std::shared_ptr<const std::vector<int>> world_hosts_;
  std::unique_ptr<detail::engine> engine_;
};


}  // namespace fsdp::mpi
