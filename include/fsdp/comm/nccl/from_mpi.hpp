#pragma once
//! \file Bootstrap of an nccl::communicator over MPI: rank 0's unique id is broadcast through an
//! fsdp::mpi communicator. Kept apart from comm/nccl/communicator.hpp so that it compiles without MPI; this
//! header needs both (link fsdp::nccl and fsdp::mpi, compile with nvcc).
//!
//!   fsdp::mpi::environment env(argc, argv);
//!   fsdp::mpi::communicator world = env.world();
//!   fsdp::cuda_device gpu{local_rank};
//!   fsdp::nccl::communicator comm = fsdp::nccl::from_mpi(world, gpu);

#include "fsdp/comm/mpi/communicator.hpp"
#include "fsdp/comm/nccl/communicator.hpp"

namespace fsdp::nccl {

//! Collective over `world`'s ranks: an NCCL communicator with the same ranks and size, on
//! `device`. Every wait is bounded by `timeout`; a peer that stops answering MPI's heartbeats
//! ends them sooner (errc::peer_failure naming it).
inline communicator from_mpi(mpi::communicator& world, const cuda_device& device, milliseconds timeout = default_timeout()) {
  unique_id id{};
  if (world.rank() == 0) id = make_unique_id();
  host_queue q{"nccl bootstrap"};
  world.broadcast(&id, sizeof(id), dtype::u8, 0, q).wait(timeout, "broadcast of the NCCL unique id");
  communicator c(device, world.rank(), world.size(), id, timeout);
  // MPI's heartbeats keep running while NCCL carries the traffic: a dead peer ends NCCL's
  // waits within seconds too (NCCL's own kernels would spin on it until the timeout).
  c.watch_peers(world.failure_probe());
  return c;
}

}  // namespace fsdp::nccl
