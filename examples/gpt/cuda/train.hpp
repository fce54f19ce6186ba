#pragma once
// gpt/cuda/train.hpp: the GPT on one GPU, sharded over N ranks (train_gpt --device cuda).
//
// With the threads backend (the default) each rank is a thread with its own cuda_device on GPU 0
// (its compute stream and memory pool) and a threads::cuda_communicator
// (comm/threads/cuda_communicator.hpp). With nccl each rank is a process of its own (started by
// example::spawn_process_ranks, common/process_ranks.hpp) over an nccl::communicator, all on
// GPU 0: NCCL 2.28 accepts two ranks on one GPU only as different hosts, so they talk through
// NCCL's socket transport, slowly; it is there to run the NCCL path, not for speed. With
// nccl_threads each rank is a thread of this process over an nccl::communicator, as NCCL 2.30
// lets ranks share a GPU (common/nccl_thread_ranks.hpp): NCCL's own transport on the device. Either way:
// the same model, initial values and batches as the host run (gpt/model.hpp, gpt/data.hpp), with
// CUDA kernels and cuBLAS (gpt/cuda/model.cuh), sharded by the same shard_group. The loop is gpt::train_rank's core:
// forward and backward through the hooks, gradient clipping, AdamW, the validation loss, every
// rank's figures each step. Checkpoints, micro-batches and the planner stay on the host
// program (train_gpt refuses them with --device cuda).
//
// This header is plain C++ (train_gpt.cpp includes it); train() is defined in
// gpt/cuda/train.cu, which nvcc compiles into train_gpt when the build has CUDA (GPT_CUDA=1).
// Not yet run on a GPU: docs/gpu.md lists it among the paths to run first.

#include <functional>
#include <string>

#include <fsdp/fsdp.hpp>

#include "common/process_ranks.hpp"
#include "gpt/data.hpp"
#include "gpt/train.hpp"

#ifndef GPT_CUDA
#define GPT_CUDA 0
#endif
#ifndef GPT_NCCL
#define GPT_NCCL 0
#endif

namespace gpt::cuda {

//! Whether this train_gpt was built with the CUDA model (examples/CMakeLists.txt).
inline constexpr bool available = GPT_CUDA != 0;
//! Whether it was built with the NCCL backend too (CMake found libnccl and nccl.h).
inline constexpr bool have_nccl = GPT_NCCL != 0;

//! How the ranks talk: thread ranks of this process over threads::cuda_communicator, one NCCL
//! rank per process, or NCCL ranks as threads of this process (NCCL 2.30 or later:
//! common/nccl_thread_ranks.hpp).
enum class backend { threads, nccl, nccl_threads };

//! What a run on the GPU is: the host run's options and the layout over the ranks.
struct request {
  run_options run{};
  int ranks = 1;                                 //!< ranks, all on GPU 0
  backend comm = backend::threads;               //!< threads, nccl_threads: `ranks` threads here; nccl: this process is rank `process`
  example::process_rank process{};               //!< nccl: this process's rank (example::this_process_rank())
  fsdp::sharding shards = fsdp::full_shard();
  bool bf16 = false;                             //!< bf16 parameters and compute, fp32 master and reduction
  int prefetch = 1;                              //!< units gathered ahead
  bool comm_high_priority = true;                //!< shard_group's collectives_high_priority
  bool time_on_device = true;                    //!< shard_group::time_on_device(): comm wait is the GPU's stall
  bool cudnn_attention = false;                  //!< cuDNN's fused attention (gpt/cuda/attention_cudnn.hpp), else the plain kernels
  bool deterministic_attention = true;           //!< cuDNN's backward: the same bits every run, or with atomics
  bool recompute = false;                        //!< blocks' activations recomputed in backward (gpt/cuda/model.cuh)
  bool fused_elementwise = false;                //!< elementwise passes fused (activation_options)
  bool cublaslt_epilogues = false;               //!< and the products' in cuBLASLt's epilogues (activation_options)
  bool keep_low_precision_shard = false;         //!< shard_group's keep_low_precision_shard (bf16)
  bool kernel_times = false;                     //!< GPU time per kernel over steps 2.. (gpt/cuda/kernel_times.hpp)
  bool registered_buffers = false;               //!< nccl, nccl_threads: the group's buffers from nccl::registered_memory
};

//! What the run reports as it goes (rank 0), as gpt::callbacks does.
struct reports {
  std::function<void(const step_report&)> on_step{};
  bool trace = false;  //!< record every rank's spans (shard_group's hooks and waits) into result::events
};

//! What the run returns: the parameter count, the device memory the activations took on each
//! rank, and every rank's trace events (with reports::trace), all ranks on one clock.
struct result {
  std::size_t model_numel = 0;
  std::size_t activation_bytes = 0;
  std::vector<std::string> events;
  std::string attention;  //!< what computed attention: "plain kernels", or cuDNN's version
  std::string kernel_times;  //!< with request::kernel_times and 2 steps or more: gpt::kernel_table's table
  std::size_t source_blocks = 0, source_bytes = 0;  //!< with registered_buffers: rank 0's blocks of NCCL's memory, bytes asked
};

//! The version of the NCCL library loaded ("2.30.7"; NCCL's, not its header's), or "" in a build
//! without NCCL: the run says which NCCL it ran on.
std::string nccl_version();

//! Throws fsdp::error(errc::no_device, "no CUDA device: ...") unless GPU 0 can be used: what a
//! launcher asks before it starts any rank, so that a machine without a GPU gets one error.
void check_device();

//! Trains `q` on GPU 0: with backend::threads and nccl_threads all q.ranks ranks (nccl_threads
//! refuses an NCCL older than 2.30 by name); with backend::nccl the one rank
//! q.process of the q.process.size processes that meet in q.process.store (cb.on_step and the
//! result's figures and events come on rank 0 only). Throws fsdp::error(errc::no_device, "no
//! CUDA device: ...") without a usable GPU, and what train_rank would throw otherwise
//! (not_finite, a rank's failure).
result train(const request& q, const corpus& text, const reports& cb);

}  // namespace gpt::cuda
