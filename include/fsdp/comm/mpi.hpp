#pragma once
//! \file The `mpi` backend: ranks are MPI processes (one or many hosts, launched by mpiexec).
//!
//! Its parts (comm/mpi/): the environment (MPI's lifetime, hosts, the world communicator), the
//! communicator (each collective as MPI operations), the engine (the one thread that makes
//! every MPI call, in rounds, in issue order, since Open MPI makes no progress on its own), one
//! operation and its completion, the failure notices, and the datatypes.
//!
//! Every wait is bounded by the communicator's timeout. MPI cannot cancel a collective, so a
//! timed-out collective leaves the engine broken: later collectives fail at once with
//! errc::peer_failure, and environment's destructor ends the job with MPI_Abort instead of
//! MPI_Finalize (which would wait forever on the stuck peer): the last resort, after the error
//! has been thrown on this rank, and after printing it (the root cause must reach the user
//! even when MPI_Abort ends the process before the program's own handler runs).
//!
//! Failing fast: each engine keeps a receive posted on a private duplicate of MPI_COMM_WORLD.
//! A rank that fails (communicator::abort(), which shard_group calls when it is left by an
//! exception, or a collective of its own that failed or timed out) sends its error text to
//! every other rank there. A rank that receives it fails every collective in flight or queued
//! with errc::peer_failure naming the failed rank and its message, within milliseconds, instead
//! of waiting out its timeout. After that the engine makes no more MPI calls for collectives
//! (their buffers may be freed), and the job ends with MPI_Abort.
//!
//! Liveness, apart from progress (comm/mpi/heartbeats.hpp): every engine beats to every other
//! each second on another private duplicate of MPI_COMM_WORLD. A process silent for 10 s
//! (killed outright, stopped, or its host unreachable) fails every survivor's collectives with
//! errc::peer_failure "rank R stopped answering (...) 10.0 s ago", whatever the collective
//! timeout, which stays for ranks that are alive but stuck. environment's third argument
//! (mpi::liveness) sets the period and the limit.
//!
//! Reductions sum in rank order (comm/rank_order_sum.hpp), so that they equal the threads
//! backend's bit for bit (comm/mpi/communicator.hpp says how).
//!
//! Hosts (comm/topology.hpp): the processes that share memory (MPI_Comm_split_type with
//! MPI_COMM_TYPE_SHARED, found at MPI_Init) are one host; every communicator knows the host of
//! each of its ranks (hosts()), so the traffic counters split off the inter-host bytes and
//! hybrid_shard_per_host() shards inside each host.
//!
//!   int main(int argc, char** argv) {
//!     fsdp::mpi::environment env(argc, argv);
//!     fsdp::mpi::communicator comm = env.world();
//!     ... fsdp::shard_group<fsdp::buffer<float>, fsdp::mpi::communicator> group{comm}; ...
//!   }

#include "fsdp/comm/mpi/environment.hpp"  // defines: mpi::environment, mpi::communicator
