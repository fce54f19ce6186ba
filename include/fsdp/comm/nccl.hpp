#pragma once
//! \file The `nccl` backend: one process (or thread) per GPU, collectives enqueued by NCCL on
//! the CUDA stream of the cuda_queue they are given.
//!
//! Bootstrap: every rank needs rank 0's ncclUniqueId. communicator::from_file_store() passes
//! it through a directory (comm/file_store.hpp); comm/nccl/from_mpi.hpp broadcasts it over MPI.
//! Communicators are created non-blocking (ncclConfig_t::blocking = 0), so that no NCCL call
//! can hang the host: a call that returns ncclInProgress is polled with ncclCommGetAsyncError
//! against the communicator's timeout.
//!
//! NCCL has no operation timeout. Every host-side wait on a collective's event (event.wait,
//! queue/device synchronize after waiting on it) polls the stream and ncclCommGetAsyncError
//! against a deadline; on an asynchronous error it aborts the communicator (ncclCommAbort, so
//! the kernels of this rank stop) and throws fsdp::error(errc::peer_failure); at the deadline
//! it aborts and throws errc::timeout, naming the collective. shard_group also aborts the
//! communicator when it is left by an exception, so peers fail at once instead of at their
//! own deadline.
//!
//! Arguments in host memory (shard_group_sum's double, a training loop's statistics; the rule is
//! detail::device_resident, device/cuda.hpp, shared with the threads backend over CUDA) are
//! staged through device memory on the queue's stream; such a call then waits for itself
//! (bounded) and returns a completed event. Device memory takes the asynchronous path.
//!
//! Reductions are NCCL's own (ring or tree, chosen by NCCL): they add the ranks in another order
//! than the host backends' rank order (comm/rank_order_sum.hpp), so a run on NCCL agrees with
//! threads and mpi to rounding, not bit for bit.
//!
//! Its parts (comm/nccl/): the communicator, its shared state (comm_state: the ncclComm_t and
//! the polling of non-blocking calls), nccl::group (collectives launched together),
//! registered_memory (zero-copy buffers for a cuda_device) and the bootstrap over MPI
//! (from_mpi.hpp).
//!
//!   fsdp::cuda_device gpu{local_rank};
//!   auto comm = fsdp::nccl::communicator::from_file_store(gpu, rank, world, fsdp::file_store{"/tmp/run42"});
//!   fsdp::shard_group<fsdp::buffer<float>, fsdp::nccl::communicator> group{comm, gpu};

#include "fsdp/comm/nccl/communicator.hpp"  // defines: nccl::communicator, nccl::group, unique_id, make_unique_id
#include "fsdp/comm/nccl/registered_memory.hpp"  // defines: nccl::registered_memory
