// gpt/cuda/train.cu: gpt::cuda::train (gpt/cuda/train.hpp), compiled by nvcc into train_gpt
// when the build has CUDA. One rank: the model on its cuda_device, sharded by a shard_group
// over threads::cuda_communicator (thread ranks) or nccl::communicator (one process per rank);
// the step is gpt::train_rank's (gpt/train.hpp) without what stays on the host program
// (checkpoints, micro-batches, the planner).

#include "gpt/cuda/train.hpp"

#include <chrono>
#include <cmath>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <fsdp/comm/threads_cuda.hpp>
#if GPT_NCCL
#include <fsdp/comm/nccl.hpp>

#include "common/nccl_thread_ranks.hpp"
#endif
#include <fsdp/device/cuda.hpp>
#include <fsdp/fsdp.hpp>

#include "gpt/cuda/kernel_times.hpp"
#include "gpt/cuda/model.cuh"

namespace gpt::cuda {
namespace {

using clock = std::chrono::steady_clock;

// Comm: threads::cuda_communicator or nccl::communicator (every collective here is one both
// have; host memory, as the step's figures are, is staged through the device by either).
// meet(): every rank meets there, after what may wait for the whole device (cuBLAS's and cuDNN's
// set-up, CUPTI's) and before a collective follows: comm.barrier(), or on NCCL thread ranks a
// meeting on the host (their collectives' kernels would be what that set-up waits for).
template <class Precision, class Comm>
void train_rank(Comm& comm, const fsdp::cuda_device& gpu, const request& q, const corpus& text, const reports& cb,
                fsdp::timeline::clock::time_point epoch, result& out, std::mutex& out_m, const std::function<void()>& meet) {
  using P = typename Precision::param_type;
  using Group = fsdp::shard_group<fsdp::buffer<P>, Precision, Comm>;
  const run_options& o = q.run;
  const int ranks = comm.size(), rank = comm.rank(), local = o.batch / ranks;

  // 1. The model and its shards, as on the host: unit 0 the embedding, one unit per block,
  //    each rank filling only its shard with the initial values; the model (cuBLAS's handle)
  //    and the activations (cuDNN's graphs) made before the ranks meet and collectives begin.
  model<P> m(o.model, gpu);
  activations acts(gpu, o.model, local, fsdp::dtype_of<P>,
                   {.attention = q.cudnn_attention ? attention_kind::cudnn : attention_kind::plain,
                    .deterministic_attention = q.deterministic_attention,
                    .recompute = q.recompute,
                    .fused_elementwise = q.fused_elementwise,
                    .cublaslt_epilogues = q.cublaslt_epilogues});
  typename Group::options opts{.sharding = q.shards,
                               .prefetch = {.forward = q.prefetch, .backward = q.prefetch},
                               .collectives_high_priority = q.comm_high_priority,
                               .keep_low_precision_shard = q.keep_low_precision_shard};
#if GPT_NCCL
  // The group's buffers (not the model's) in NCCL's registered memory: its collectives zero-copy.
  if constexpr (std::is_same_v<Comm, fsdp::nccl::communicator>)
    if (q.registered_buffers) gpu.use_memory(fsdp::nccl::registered_memory(comm));
#endif
  meet();
  Group group{comm, gpu, opts};
  add_units(group, m.parameters(), o.freeze);
  group.finalize(initial_values(o));
  fsdp::adamw opt{group, {.lr = o.lr, .weight_decay = 0.0f}};
  std::optional<fsdp::timeline> tl;
  if (cb.trace) group.profile().record_timeline(&tl.emplace(epoch));
  // Collectives and compute's waits for them timed on the GPU: the report's "comm wait" is the
  // time compute stalled on communication (exposed), and the trace gets the collectives' lanes.
  if (q.time_on_device) group.time_on_device();
  const std::vector<std::vector<std::string>> names = parameter_names(m.parameters());
  std::vector<rank_step> all(static_cast<std::size_t>(ranks));
  fsdp::cuda_queue stats{"stats"};
  const auto run_start = clock::now();
  // --kernel-times: the GPU's work of steps 2.. (the first warms up cuBLAS, cuDNN and the pools),
  // every rank's (one process's records); rank 0 records, the ranks start step 2 after it began.
  std::optional<kernel_times> times;
  const bool record_kernels = q.kernel_times && o.steps > 1;

  for (int step = 0; step < o.steps; ++step) {
    const auto t0 = clock::now();
    const fsdp::traffic_counters sent_before = group.traffic();
    const auto wait_before = group.profile().communication_wait();
    gpu.reset_peak_memory();

    // 2. This rank's slice of the global batch, forward and backward through the hooks
    //    (reading the loss is the step's one wait for the GPU), clipping, AdamW.
    rank_step mine;
    const batch b = make_batch(text, false, o.seed, static_cast<std::uint64_t>(step), rank * local, local, o.model.seq);
    mine.loss = forward_backward(group, m, acts, b.tokens, b.targets, local);
    // Clipping in AdamW's own pass (one pass over the gradients fewer than clip_grad_norm), by
    // the factor clip_on_device leaves in the GPU's memory: the update is queued without waiting
    // for the norm, which is read after it (the same bits as step(clip_coefficient(grad_norm))).
    opt.options().lr = learning_rate(o, step);
    if (o.clip > 0 && o.clip_in_optimizer) {
      const auto clip = fsdp::clip_on_device(group, o.clip);
      opt.step(clip);
      mine.grad_norm = clip.norm();
    } else {
      if (o.clip > 0) mine.grad_norm = fsdp::clip_grad_norm(group, o.clip);
      opt.step();
    }
    opt.zero_grad();
    gpu.synchronize(comm.timeout());  // the step's time is the GPU's
    take_step_figures(mine, group, t0, run_start, sent_before, wait_before);
    // The activations live on the same cuda_device, so its counter holds them too (allocated
    // once, before the first step, never freed): take them out, so that the figures are the
    // model state's, as the host run's are (there the activations are plain vectors).
    mine.peak -= acts.bytes();
    mine.persistent -= acts.bytes();

    // 3. The validation loss every eval_every steps and after the last.
    const bool evaluate = o.eval_every > 0 && (step % o.eval_every == 0 || step + 1 == o.steps);
    if (evaluate) mine.val_loss = validation_loss(group, m, acts, o, text, rank, local);

    // 4. Every rank's figures (host memory: the communicator stages them).
    comm.all_gather(&mine, all.data(), sizeof(rank_step), fsdp::dtype::u8, stats).wait(comm.timeout());
    const step_report report{step, all};
    if (rank == 0 && cb.on_step) cb.on_step(report);
    if (std::string bad = nonfinite_message(report, evaluate, o.clip > 0, o.lr, names); !bad.empty()) throw not_finite(bad);
    if (record_kernels && step == 0) {
      if (rank == 0) times.emplace().start();
      meet();
    }
  }
  if (record_kernels) meet();  // every rank's GPU work has ended (each waited for its own)
  if (times) times->stop();
  if (tl) group.profile().record_timeline(nullptr);
  std::vector<std::string> events = tl ? gather_strings(comm, tl->chrome_events()) : std::vector<std::string>{};
  if (rank == 0) {
    std::lock_guard lock(out_m);
    out.model_numel = m.numel();
    out.activation_bytes = acts.bytes();
    out.events = std::move(events);
    out.attention = acts.fused() ? acts.fused()->version() : "plain kernels";
    const auto held = gpu.memory_source_held();
    out.source_blocks = held.blocks;
    out.source_bytes = held.bytes;
    if (times) {
      out.kernel_times = times->table().format(o.steps - 1);
      if (times->dropped() > 0) out.kernel_times += "  (" + std::to_string(times->dropped()) + " records lost: the table undercounts)\n";
    }
  }
}

// train_rank in the run's precision; meet: comm.barrier() unless given.
template <class Comm>
void run_rank(Comm& comm, const fsdp::cuda_device& gpu, const request& q, const corpus& text, const reports& cb,
              fsdp::timeline::clock::time_point epoch, result& out, std::mutex& out_m, std::function<void()> meet = {}) {
  if (!meet) meet = [&comm] { comm.barrier(); };
  if (q.bf16)
    train_rank<fsdp::mixed_precision<fsdp::bf16, float, float>>(comm, gpu, q, text, cb, epoch, out, out_m, meet);
  else
    train_rank<fsdp::full_precision<float>>(comm, gpu, q, text, cb, epoch, out, out_m, meet);
}

// backend::nccl: this process is one rank. Rank 0 writes the ncclUniqueId into the launcher's
// store folder, the others read it there (bounded by the communicator's timeout, as is every
// wait after it). backend::nccl_threads: every rank a thread of this process with its own
// communicator on GPU 0 (NCCL 2.30 or later; common/nccl_thread_ranks.hpp refuses an older one by
// name).
result train_nccl(const request& q, const corpus& text, const reports& cb) {
#if GPT_NCCL
  result out;
  std::mutex out_m;
  if (q.comm == backend::nccl_threads) {
    check_device();  // no GPU: one clear error here, before any rank starts
    const auto epoch = fsdp::timeline::clock::now();  // one clock for every rank's trace
    example::run_nccl_thread_ranks({.ranks = q.ranks}, [&](fsdp::nccl::communicator& comm, const fsdp::cuda_device& gpu,
                                                           const std::function<void()>& meet) {
      run_rank(comm, gpu, q, text, cb, epoch, out, out_m, meet);
    });
    return out;
  }
  const example::process_rank& me = q.process;
  if (me.size != q.ranks)
    throw fsdp::error(fsdp::errc::invalid_argument, "--backend nccl: this process is one of " + std::to_string(me.size) +
                                                        " ranks, the run asks for " + std::to_string(q.ranks));
  const fsdp::cuda_device gpu{0};
  auto comm = fsdp::nccl::communicator::from_file_store(gpu, me.rank, me.size, fsdp::file_store{me.store});
  comm.barrier();  // the processes start their trace clocks together (one host: one monotonic clock)
  const auto epoch = fsdp::timeline::clock::now();
  run_rank(comm, gpu, q, text, cb, epoch, out, out_m);
  return out;
#else
  (void)text, (void)cb;
  throw fsdp::error(fsdp::errc::no_device, "--backend nccl: this train_gpt_cuda was built without NCCL (CMake found no libnccl "
                                           "and nccl.h); rank " + std::to_string(q.process.rank) + " cannot start");
#endif
}

}  // namespace

void check_device() { fsdp::cuda_device probe{0}; }

std::string nccl_version() {
#if GPT_NCCL
  return example::nccl_version_string(example::nccl_version());
#else
  return "";
#endif
}

result train(const request& q, const corpus& text, const reports& cb) {
  if (q.cudnn_attention) choose_cudnn_cudart();  // before any rank's thread starts
  if (q.run.batch % q.ranks != 0)
    throw fsdp::error(fsdp::errc::invalid_argument, "the global batch (" + std::to_string(q.run.batch) +
                                                        ") must be a multiple of the number of ranks (" + std::to_string(q.ranks) + ")");
  if (q.comm != backend::threads) return train_nccl(q, text, cb);
  check_device();  // no GPU: one clear error here, before any rank starts
  result out;
  std::mutex out_m;
  const auto epoch = fsdp::timeline::clock::now();  // one clock for every rank's trace
  fsdp::threads::world{q.ranks}.run([&](fsdp::threads::communicator& host) {
    const fsdp::cuda_device gpu{0};
    fsdp::threads::cuda_communicator comm{std::move(host), gpu};
    run_rank(comm, gpu, q, text, cb, epoch, out, out_m);
  });
  return out;
}

}  // namespace gpt::cuda
