// train_gpt: a small GPT trained byte by byte on real English text, sharded with fsdp.
//
// The model (gpt/model.hpp) is a GPT-2-style decoder written in plain C++ with a hand-written
// backward pass; fsdp shards it over N ranks: one unit for the embedding (whose token table is
// also the LM head), one per transformer block. Every rank holds only its shard of each unit;
// a unit is all-gathered just before it runs and freed after, its gradient reduce-scattered
// into the gradient shard, and AdamW steps the shards.
//
//   train_gpt                                    4 thread ranks, full sharding, fp32
//   train_gpt --ranks 8 --sharding hybrid:4 --precision bf16
//   train_gpt --trace trace.json --loss-csv loss.csv --loss-plot loss.svg
//   mpiexec -n 4 train_gpt --backend mpi         4 processes (when built with MPI)
//   train_gpt --device cuda --ranks 4 --precision bf16   4 thread ranks on one GPU (built with CUDA)
//   train_gpt --device cuda --backend nccl --ranks 2     2 NCCL ranks, each a process, on one GPU
//
// It prints a line per step (loss, tokens/s, each rank's peak memory, bytes sent and time spent
// waiting for communication), the validation loss every --eval-every steps, and a summary
// comparing each rank's memory with what an unsharded copy of the model needs.
//
// It fails with one line, "train_gpt: <what>": exit 2 for a bad option, an output file or
// directory it cannot write, a --save disk without room for a checkpoint, or a model too big
// for the machine (all found before training starts); exit 1
// for a failure while it runs (a loss that is not finite, out of memory, a failed write, a rank
// that failed). What it keeps per step is bounded: the CSV is written a row at a time, the plot
// keeps a thinned curve.

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iomanip>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <atomic>
#include <chrono>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "common/launch.hpp"
#include "common/options.hpp"
#include "gpt/cuda/train.hpp"
#include "gpt/memory.hpp"
#include "gpt/parallel.hpp"
#include "gpt/train.hpp"

namespace {

// The stop signal that ended this process's run (gpt::run_result::stopped_by), 0 when none:
// run() exits with its status.
std::atomic<int> stopped_by{0};

struct options {
  gpt::run_options run{};
  int ranks = 4;
  int hosts = 1;  // threads backend: simulated hosts
  std::string backend = "threads";
  std::string device = "host";         // --device cuda: the model's CUDA kernels, thread (or NCCL process) ranks on GPU 0
  std::string sharding = "full";
  fsdp::sharding shards = fsdp::full_shard();  // what --sharding says
  std::string precision = "fp32";
  int prefetch = 1;
  std::string comm_priority = "high";  // --device cuda: the collectives' streams' priority
  std::string device_timing = "on";    // --device cuda: collectives and their waits timed on the GPU
  std::string nccl_ranks = "processes";  // --device cuda --backend nccl: each rank a process, or a thread here
  std::string nccl_buffers = "pool";     // --device cuda --backend nccl: the group's buffers from fsdp's pool, or registered
  bool kernel_times = false;           // --device cuda: the GPU time of every kernel, through CUPTI
  std::string clip_pass = "fused";     // clipping in AdamW's pass, or a pass of its own
  std::string low_precision_shard = "cast";  // --precision bf16: the bf16 shard cast at each gather, or kept
  std::string attention = "plain";     // --device cuda: the plain kernels, or cuDNN's fused attention
  std::string attention_backward = "deterministic";  // --attention cudnn: its backward's algorithm
  std::string elementwise = "separate";  // --device cuda: each elementwise pass its own, fused, or in cuBLASLt's epilogues
  std::string bucket = "unit";
  std::size_t bucket_bytes = 0;  // --bucket BYTES; 0: one bucket per unit (unit, and auto until its plan)
  double link_latency_ms = 0, link_mbps = 0;  // threads backend: a modelled link (0: none)
  std::string data = gpt::default_corpus_dir;
  std::string trace, loss_csv, loss_plot;
  std::string log_dir;
  std::string export_dtype = "f32";
  std::string save_mode = "sync";
  std::string matmul = gpt::have_blas ? "blas" : "loops";
  bool offload = false;                // --offload: every bucket's sharded state in host memory
  int reshard_to = 0;                  // --reshard-after-forward K: hpZ's secondary shard over K ranks
  std::string micro_sync = "last";     // --micro-sync: reduce after the last micro-batch, or after each
  std::string gather_dtype = "param";  // int8 / fp8: the parameters' all-gather through fsdp::int8_all_gather / fp8_all_gather
  gpt::parallel_options mesh{};        // --tp, --pp, --schedule, --recompute (gpt/parallel.hpp)
  std::string schedule = "1f1b";
  // --recompute alone: on the mesh driver on the host; the CUDA model recomputes by itself.
  bool on_mesh() const {
    return mesh.mesh.tp > 1 || mesh.mesh.pp > 1 || (mesh.recompute && device != "cuda") || run.model.experts > 0;
  }
};

const char* usage =
    "usage: train_gpt [options]\n"
    "  --ranks N          thread ranks (default 4; with mpi: the number of processes; with --device cuda\n"
    "                     --backend nccl: the processes it starts)\n"
    "  --backend B        threads | mpi (run under mpiexec) | nccl (with --device cuda; see docs/gpu.md)\n"
    "  --device D         host (the default) | cuda: the model as CUDA kernels and cuBLAS, every rank on GPU 0:\n"
    "                     threads (fsdp::threads::cuda_communicator), or with --backend nccl each rank a process\n"
    "                     of its own (fsdp::nccl::communicator over sockets: slow, for correctness); with\n"
    "                     --sharding full|grad_op|hybrid:S|none, --precision, --prefetch, --freeze, --trace,\n"
    "                     --loss-csv, --loss-plot (built with CUDA)\n"
    "  --nccl-ranks R     --device cuda --backend nccl: processes (the default: each rank a process with its\n"
    "                     own NCCL_HOSTID, over sockets) or threads (each rank a thread of this process:\n"
    "                     NCCL 2.30's ranks sharing a GPU, NCCL_MULTI_RANK_GPU_ENABLE; refused before 2.30)\n"
    "  --nccl-buffers B   --device cuda --backend nccl: pool (the default: the shard group's buffers from\n"
    "                     fsdp's memory pool) or registered (from ncclMemAlloc, registered with the\n"
    "                     communicator: NCCL's zero-copy collectives; not yet run on a GPU)\n"
    "  --hosts N          threads backend: split the ranks into N simulated hosts (for --sharding hybrid\n"
    "                     and the inter-host byte count; default 1). MPI finds its hosts itself\n"
    "  --sharding S       full | grad_op | hybrid (shard inside each host, replicate across hosts) |\n"
    "                     hybrid:SHARD_SIZE | none | auto[:MiB] (profile 3 steps with full sharding, measure\n"
    "                     the links inside and across hosts, then the shard size the planner's model finds\n"
    "                     fastest, under a per-rank memory limit; it prints its table; default full)\n"
    "  --precision P      fp32 | bf16 (bf16 params and compute, fp32 reduce and master; default fp32)\n"
    "  --prefetch N       units gathered ahead in forward and backward (default 1; 0: none)\n"
    "  --comm-priority P  --device cuda: the all-gather and reduce-scatter streams at high (the default)\n"
    "                     or normal priority\n"
    "  --device-timing T  --device cuda: on (the default) times the collectives and compute's waits for\n"
    "                     them on the GPU, so comm wait is the exposed communication and --trace has their\n"
    "                     lanes; off: host clocks only\n"
    "  --kernel-times     --device cuda: after the run, the GPU time a step of every kernel (CUPTI's\n"
    "                     records, steps 2..): each owner's share (model, cuBLAS, cuDNN, fsdp, NCCL) and\n"
    "                     the largest kernels\n"
    "  --attention A      --device cuda: plain (the default: kernels with the T x T scores in f32) or\n"
    "                     cudnn (cuDNN's fused flash attention, bf16 operands, no T x T matrix; needs\n"
    "                     libcudnn.so.9 at run time)\n"
    "  --attention-backward A  --attention cudnn: deterministic (the default: the same bits every run,\n"
    "                     through a B x H x T x T workspace) or nondeterministic (cuDNN sums dQ with\n"
    "                     atomics)\n"
    "  --elementwise E    --device cuda: separate (the default: each elementwise pass its own, a cast\n"
    "                     before each bf16 product) or fused (a product's bias added in the pass after it,\n"
    "                     with the residual, GELU or the cast; with bf16 each product's operands written\n"
    "                     by the kernel that makes their values; the same bits; not yet run on a GPU) or\n"
    "                     cublaslt (fused, and each product's bias, GELU, GELU's backward and residual\n"
    "                     connection in its cuBLASLt epilogue, writing bf16 where bf16 is read next; needs\n"
    "                     --precision bf16; bf16's rounding, not the same bits; not yet run on a GPU)\n"
    "  --clip-pass P      fused (the default): the gradient-norm clipping in AdamW's own pass\n"
    "                     (fsdp::grad_norm, clip_coefficient, step(grad_scale)); separate: clip_grad_norm\n"
    "                     scales the gradients in a pass of its own (the same losses; an A/B on a GPU)\n"
    "  --low-precision-shard S  --precision bf16: cast (the default: each gather casts this rank's f32\n"
    "                     master shard to bf16) or keep (a persistent bf16 copy of the shard, written in\n"
    "                     AdamW's pass and gathered as it is: 2 more bytes a parameter, two passes a step\n"
    "                     fewer; the same losses)\n"
    "  --freeze NAMES     parameters to keep as they are, comma-separated (e.g. wte,wpe or block0.qkv_w):\n"
    "                     gathered for forward and backward, no gradient, no reduction, no AdamW state\n"
    "  --gather-dtype D   param (gather in the param dtype, the default) | int8 | fp8 (threads and mpi: send\n"
    "                     int8 or fp8 e4m3 with a float scale per 256 elements, ZeRO++'s qwZ;\n"
    "                     fsdp::int8_all_gather / fp8_all_gather)\n"
    "  --matmul M         blas (OpenBLAS's sgemm, the default where the build found it) | loops (the plain\n"
    "                     loops the parity tests use)\n"
    "  --bucket B         unit (one collective per unit) | BYTES (merge units up to BYTES) |\n"
    "                     auto[:MiB] (profile 3 steps, then the planner's buckets and issue points\n"
    "                     under a per-rank memory limit; default unit)\n"
    "  --steps N          training steps (default 200)\n"
    "  --batch N          global batch in sequences, a multiple of the ranks (default 16)\n"
    "  --reshard-after-forward K\n"
    "                     hpZ (FSDP2's reshard_after_forward=K): after forward keep a secondary shard over\n"
    "                     runs of K ranks (a host's, say), so backward gathers inside them; K divides\n"
    "                     the shard group and is smaller\n"
    "  --offload          the sharded state (master, gradient and AdamW shards) in host memory, stepped on\n"
    "                     the host (FSDP2's CPUOffloadPolicy); per bucket: fsdp::offload{.units = ...}\n"
    "  --micro-batches K  gradient accumulation: each rank's batch in K micro-batches (default 1)\n"
    "  --tp N             tensor parallel (Megatron): each block's heads and MLP split over N ranks, two\n"
    "                     all-reduces per block and pass; N divides --heads (default 1)\n"
    "  --pp N             pipeline parallel: the layers in N stages, activations passed by send/recv,\n"
    "                     --micro-batches K per step (default 1); fsdp shards each stage's TP slice\n"
    "                     over the remaining --ranks / (tp x pp) data-parallel ranks (gpt/parallel.hpp)\n"
    "  --schedule S       1f1b (the default) | gpipe: the pipeline's order of micro-batches\n"
    "  --recompute        re-run each block's forward inside its backward (activation checkpointing)\n"
    "                     instead of keeping its activations; the block is gathered once for both\n"
    "                     (on the host: the mesh driver, gpt/parallel.hpp; --device cuda: the blocks\n"
    "                     share one set of activation buffers, room for bigger batches)\n"
    "  --experts E        each block's MLP a mixture of E experts (top-k routing, gpt/moe.hpp)\n"
    "  --top-k K          with --experts: the experts each token goes to (default 2)\n"
    "  --ep N             with --experts: spread them over groups of N data-parallel ranks, tokens\n"
    "                     dispatched by all-to-all; each expert sharded over the ranks holding it\n"
    "  --micro-sync S     last (gradients accumulate unsharded, reduced after the last micro-batch; the\n"
    "                     default) | each (reduce-scatter every micro-batch; hybrid all-reduces across\n"
    "                     replicas after the last only, FSDP2's set_requires_all_reduce(False))\n"
    "  --seq N            sequence length in bytes (default 64)\n"
    "  --layers N         transformer blocks (default 4)\n"
    "  --dim N            model width (default 64)\n"
    "  --heads N          attention heads, dividing --dim (default 4)\n"
    "  --lr X             AdamW learning rate (default 0.003)\n"
    "  --seed N           initial values and batches (default 1)\n"
    "  --data PATH        a text file or directory (default /usr/share/games/fortunes)\n"
    "  --eval-every N     validation loss every N steps and after the last (default 25; 0: never)\n"
    "  --link-latency-ms X, --link-mbps Y\n"
    "                     threads backend: a modelled network link per rank (latency, MB/s), so that\n"
    "                     communication takes time and its overlap with compute shows\n"
    "  --trace FILE       write a Chrome/Perfetto trace (JSON) of every rank's compute and communication\n"
    "                     (every span of every step is held in memory until the end: for short runs)\n"
    "  --loss-csv FILE    write the loss curve as CSV (step,train_loss,val_loss), a row per step as it ends,\n"
    "                     losses to the last bit (17 significant digits)\n"
    "  --loss-plot FILE   write the loss curve as an SVG plot (at most 2048 points: long runs are thinned)\n"
    "  --log-dir DIR      each rank's output and errors also into DIR/rank_<r>.log, written at every line\n"
    "                     (as torchrun's): a rank's cause of failure is kept even when its output to the\n"
    "                     terminal is lost (a remote rank's goes over the network)\n"
    "  --save DIR         checkpoints (sharded safetensors + index.json) into DIR/step_<8 digits>/ after\n"
    "                     the last step, and every N steps with --save-every N\n"
    "  --save-mode M      sync | async: write each checkpoint in the background while training goes on\n"
    "                     (the step waits only for the host copy; complete at a later step's end)\n"
    "  --resume PATH      continue from a checkpoint (PATH/index.json) or from the latest complete one in\n"
    "                     PATH, to --steps; other --ranks, --sharding, --bucket, --precision reshard it\n"
    "  --export FILE      after the last step, the full parameters as one safetensors file\n"
    "  --export-dtype T   f32 | bf16 (default f32)\n"
    "The output files and directories (and the room for a checkpoint under --save) are checked\n"
    "before training starts. A model too big for this machine's memory\n"
    "is refused up front (exit 2, as bad options are); a loss that is not finite stops the run, naming\n"
    "the step and the first non-finite gradient and parameter (exit 1); so does any other failure.\n"
    "SIGTERM, SIGINT or SIGUSR1 (preemption; on any rank) stops every rank after the step it is in,\n"
    "saves a checkpoint there with --save, and exits 128 + the signal (143 for SIGTERM); a second\n"
    "signal ends the process at once.\n";

options parse(int argc, char** argv) {
  options o;
  auto& r = o.run;
  using example::in;
  example::parser p{"train_gpt", usage};
  p.flag("--ranks", o.ranks, in(1, 1024))
      .flag("--backend", o.backend)
      .flag("--device", o.device)
      .flag("--hosts", o.hosts, in(1, 1024))
      .flag("--sharding", o.sharding)
      .flag("--precision", o.precision)
      .flag("--prefetch", o.prefetch, in(0, 64))
      .flag("--comm-priority", o.comm_priority)
      .flag("--device-timing", o.device_timing)
      .flag("--nccl-ranks", o.nccl_ranks)
      .flag("--nccl-buffers", o.nccl_buffers)
      .toggle("--kernel-times", o.kernel_times)
      .flag("--clip-pass", o.clip_pass)
      .flag("--low-precision-shard", o.low_precision_shard)
      .flag("--attention", o.attention)
      .flag("--attention-backward", o.attention_backward)
      .flag("--elementwise", o.elementwise)
      .flag("--matmul", o.matmul)
      .flag("--gather-dtype", o.gather_dtype)
      .flag("--freeze", [&](const char* v) {
        for (std::string_view rest = v; !rest.empty();) {
          const std::size_t comma = rest.find(',');
          r.freeze.emplace_back(rest.substr(0, comma));
          rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
        }
      })
      .flag("--bucket", o.bucket)
      .flag("--steps", r.steps, in(1, 1 << 20))
      .flag("--batch", r.batch, in(1, 1 << 20))
      .flag("--micro-batches", r.micro_batches, in(1, 1 << 20))
      .flag("--micro-sync", o.micro_sync)
      .flag("--reshard-after-forward", o.reshard_to, in(2, 1 << 20))
      .toggle("--offload", o.offload)
      .flag("--tp", o.mesh.mesh.tp, in(1, 1024))
      .flag("--pp", o.mesh.mesh.pp, in(1, 1024))
      .flag("--schedule", o.schedule)
      .toggle("--recompute", o.mesh.recompute)
      .flag("--experts", r.model.experts, in(1, 1024))
      .flag("--top-k", r.model.top_k, in(1, 1024))
      .flag("--ep", o.mesh.mesh.ep, in(1, 1024))
      .flag("--seq", r.model.seq, in(2, 4096))
      .flag("--layers", r.model.layers, in(1, 256))
      .flag("--dim", r.model.dim, in(1, 8192))
      .flag("--heads", r.model.heads, in(1, 256))
      .flag("--seed", r.seed, in(0, 1L << 62))
      .flag("--eval-every", r.eval_every, in(0, 1 << 20))
      .flag("--data", o.data)
      .flag("--trace", o.trace)
      .flag("--loss-csv", o.loss_csv)
      .flag("--loss-plot", o.loss_plot)
      .flag("--log-dir", o.log_dir)
      .flag("--save", r.save_dir)
      .flag("--save-every", r.save_every, in(1, 1 << 30))
      .flag("--save-mode", o.save_mode)
      .flag("--resume", r.resume)
      .flag("--export", r.export_path)
      .flag("--export-dtype", o.export_dtype)
      .flag("--link-latency-ms", o.link_latency_ms, example::non_negative())
      .flag("--link-mbps", o.link_mbps, example::non_negative())
      .flag("--lr", r.lr, example::positive());
  p.parse(argc, argv);

  if (o.matmul != "loops" && o.matmul != "blas") p.fail("--matmul must be blas or loops, got '" + o.matmul + "'");
  if (o.matmul == "blas" && !gpt::have_blas) p.fail("--matmul blas: this build has no OpenBLAS (install libopenblas-dev and rebuild)");
  if (o.precision != "fp32" && o.precision != "bf16") p.fail("--precision must be fp32 or bf16, got '" + o.precision + "'");
  if (o.gather_dtype != "param" && o.gather_dtype != "int8" && o.gather_dtype != "fp8")
    p.fail("--gather-dtype must be param, int8 or fp8, got '" + o.gather_dtype + "'");
  if (o.gather_dtype != "param" && o.backend == "nccl") p.fail("--gather-dtype " + o.gather_dtype + " runs on the host (threads, mpi); not with nccl");
  if (o.backend != "threads" && o.backend != "mpi" && o.backend != "nccl")
    p.fail("--backend must be threads, mpi or nccl, got '" + o.backend + "'");
  if (o.sharding.rfind("auto", 0) == 0) {
    if (o.sharding.size() > 4 && o.sharding[4] != ':') p.fail("--sharding auto takes an optional :MiB limit, got '" + o.sharding + "'");
    const long mib = o.sharding.size() > 5 ? p.integer("--sharding auto:", o.sharding.c_str() + 5, in(1, 1L << 30)) : 0;
    r.auto_sharding = static_cast<std::size_t>(mib) << 20;
    o.shards = fsdp::full_shard();  // what the step is recorded with (and the size check assumes)
  } else {
    o.shards = example::parse_sharding(p, o.sharding);
  }
  if (o.reshard_to > 0) {
    if (r.auto_sharding) p.fail("--reshard-after-forward sets the shard group's layout; it does not go with --sharding auto");
    if (!o.shards.reshard_after_forward) p.fail("--reshard-after-forward needs a sharding that reshards after forward (full or hybrid)");
    o.shards.reshard_after_forward_to = o.reshard_to;
  }
  if (o.bucket.rfind("auto", 0) == 0) {
    if (o.bucket.size() > 4 && o.bucket[4] != ':') p.fail("--bucket auto takes an optional :MiB limit, got '" + o.bucket + "'");
    const long mib = o.bucket.size() > 5 ? p.integer("--bucket auto:", o.bucket.c_str() + 5, in(1, 1L << 30)) : 0;
    r.auto_plan = fsdp::auto_bucket{.memory_limit = static_cast<std::size_t>(mib) << 20};
  } else if (o.bucket != "unit") {
    o.bucket_bytes = static_cast<std::size_t>(p.integer("--bucket", o.bucket.c_str(), in(1, 1L << 40)));
  }
  if (r.save_every > 0 && r.save_dir.empty()) p.fail("--save-every needs --save DIR");
  if (o.save_mode != "sync" && o.save_mode != "async") p.fail("--save-mode must be sync or async, got '" + o.save_mode + "'");
  if (o.save_mode != "sync" && r.save_dir.empty()) p.fail("--save-mode needs --save DIR");
  r.save_async = o.save_mode == "async";
  if (o.export_dtype != "f32" && o.export_dtype != "bf16") p.fail("--export-dtype must be f32 or bf16, got '" + o.export_dtype + "'");
  if (o.export_dtype != "f32" && r.export_path.empty()) p.fail("--export-dtype needs --export FILE");
  r.export_dtype = o.export_dtype == "bf16" ? fsdp::dtype::bf16 : fsdp::dtype::f32;
  if ((o.link_latency_ms > 0) != (o.link_mbps > 0)) p.fail("--link-latency-ms and --link-mbps go together");
  if (o.link_mbps > 0 && o.backend != "threads") p.fail("--link-* models the threads backend's link; it has no effect on " + o.backend);
  if (o.micro_sync != "last" && o.micro_sync != "each") p.fail("--micro-sync must be last or each, got '" + o.micro_sync + "'");
  r.reduce_each_micro_batch = o.micro_sync == "each";
  // --ranks is the run's size except under mpiexec, which says how many (checked there, by each rank).
  if (o.backend != "mpi" && !o.on_mesh() && r.batch % o.ranks != 0)
    p.fail("--batch (" + std::to_string(r.batch) + ") must be a multiple of --ranks (" + std::to_string(o.ranks) + ")");
  if (o.backend != "mpi" && o.shards.shard_size > 0 && o.ranks % o.shards.shard_size != 0)
    p.fail("--sharding " + o.sharding + ": a shard group of " + std::to_string(o.shards.shard_size) + " ranks does not divide --ranks (" +
           std::to_string(o.ranks) + ")");
  if (o.backend != "mpi" && !o.on_mesh() && r.batch % o.ranks == 0 && (r.batch / o.ranks) % r.micro_batches != 0)
    p.fail("--micro-batches (" + std::to_string(r.micro_batches) + ") must divide each rank's batch (--batch / --ranks = " +
           std::to_string(r.batch / o.ranks) + ")");
  for (const std::string& name : r.freeze)
    if (!gpt::is_parameter_name(r.model, name))
      p.fail("--freeze: '" + name + "' is not a parameter of this model (wte, wpe, lnf_w, lnf_b, block<l>.<ln1_w|ln1_b|qkv_w|qkv_b|"
             "proj_w|proj_b|ln2_w|ln2_b|fc_w|fc_b|out_w|out_b> for l < --layers)");
  if (r.model.dim % r.model.heads != 0)
    p.fail("--dim (" + std::to_string(r.model.dim) + ") must be a multiple of --heads (" + std::to_string(r.model.heads) + ")");
  if ((!o.trace.empty() && (o.trace == o.loss_csv || o.trace == o.loss_plot)) || (!o.loss_csv.empty() && o.loss_csv == o.loss_plot))
    p.fail("--trace, --loss-csv and --loss-plot must name different files");
  if (o.hosts > 1 && o.backend != "threads") p.fail("--hosts simulates hosts on the threads backend; " + o.backend + " finds its own");
  if (o.ranks % o.hosts != 0)
    p.fail("--hosts (" + std::to_string(o.hosts) + ") must divide --ranks (" + std::to_string(o.ranks) + ")");
  if (o.device == "cuda" && o.backend == "mpi")  // before the MPI check: said the same with or without MPI
    p.fail("--device cuda: --backend mpi runs on the host program only; on the GPU the ranks are threads (--backend "
           "threads, the default) or processes (--backend nccl)");
  if (o.backend == "mpi" && !example::have_mpi) p.fail("this build has no MPI (install libopenmpi-dev and rebuild)");
  if (o.device != "host" && o.device != "cuda") p.fail("--device must be host or cuda, got '" + o.device + "'");
  if (o.schedule != "1f1b" && o.schedule != "gpipe") p.fail("--schedule must be 1f1b or gpipe, got '" + o.schedule + "'");
  o.mesh.schedule = o.schedule == "gpipe" ? gpt::pipeline_schedule::gpipe : gpt::pipeline_schedule::one_f_one_b;
  if (o.on_mesh()) {
    // What the mesh driver (gpt/parallel.hpp) does not do: say so instead of ignoring the flag.
    auto not_on_mesh = [&](bool given, const std::string& flag) {
      if (given) p.fail(flag + " does not go with --tp, --pp, --recompute or --experts (gpt/parallel.hpp trains without it)");
    };
    not_on_mesh(o.device != "host", "--device " + o.device);
    not_on_mesh(r.auto_sharding.has_value() || o.shards.shard_size == fsdp::sharding::per_host, "--sharding " + o.sharding);
    not_on_mesh(o.bucket != "unit", "--bucket " + o.bucket);
    not_on_mesh(!r.freeze.empty(), "--freeze");
    not_on_mesh(o.gather_dtype != "param", "--gather-dtype " + o.gather_dtype);
    not_on_mesh(o.reshard_to > 0, "--reshard-after-forward");
    not_on_mesh(r.reduce_each_micro_batch, "--micro-sync each");
    not_on_mesh(!r.save_dir.empty() || !r.resume.empty() || !r.export_path.empty(), "--save/--resume/--export");
    not_on_mesh(!o.trace.empty() || !o.loss_plot.empty(), "--trace/--loss-plot");
    not_on_mesh(o.link_mbps > 0, "--link-*");
    const int tp_pp = o.mesh.mesh.tp * o.mesh.mesh.pp;
    if (o.backend == "threads" && o.ranks % tp_pp != 0)
      p.fail("--ranks (" + std::to_string(o.ranks) + ") must be a multiple of --tp x --pp (" + std::to_string(tp_pp) + ")");
    if (r.model.heads % o.mesh.mesh.tp != 0)
      p.fail("--tp (" + std::to_string(o.mesh.mesh.tp) + ") must divide --heads (" + std::to_string(r.model.heads) + ")");
    if (r.model.experts > 0 && r.model.top_k > r.model.experts)
      p.fail("--top-k (" + std::to_string(r.model.top_k) + ") must not exceed --experts (" + std::to_string(r.model.experts) + ")");
    if (o.mesh.mesh.ep > 1 && (r.model.experts == 0 || r.model.experts % o.mesh.mesh.ep != 0))
      p.fail("--ep (" + std::to_string(o.mesh.mesh.ep) + ") needs --experts, a multiple of it");
    if (r.model.layers < o.mesh.mesh.pp)
      p.fail("--pp (" + std::to_string(o.mesh.mesh.pp) + ") must not exceed --layers (" + std::to_string(r.model.layers) + ")");
  }
  if (o.comm_priority != "high" && o.comm_priority != "normal") p.fail("--comm-priority must be high or normal, got '" + o.comm_priority + "'");
  if (o.device_timing != "on" && o.device_timing != "off") p.fail("--device-timing must be on or off, got '" + o.device_timing + "'");
  if (o.nccl_ranks != "processes" && o.nccl_ranks != "threads") p.fail("--nccl-ranks must be processes or threads, got '" + o.nccl_ranks + "'");
  if (o.nccl_ranks != "processes" && (o.device != "cuda" || o.backend != "nccl"))
    p.fail("--nccl-ranks says how NCCL's ranks run on the GPU: it needs --device cuda --backend nccl");
  if (o.nccl_buffers != "pool" && o.nccl_buffers != "registered")
    p.fail("--nccl-buffers must be pool or registered, got '" + o.nccl_buffers + "'");
  if (o.nccl_buffers != "pool" && (o.device != "cuda" || o.backend != "nccl"))
    p.fail("--nccl-buffers says where NCCL's buffers come from: it needs --device cuda --backend nccl");
  if (o.clip_pass != "fused" && o.clip_pass != "separate") p.fail("--clip-pass must be fused or separate, got '" + o.clip_pass + "'");
  r.clip_in_optimizer = o.clip_pass == "fused";
  if (o.low_precision_shard != "cast" && o.low_precision_shard != "keep")
    p.fail("--low-precision-shard must be cast or keep, got '" + o.low_precision_shard + "'");
  if (o.low_precision_shard == "keep" && o.precision != "bf16")
    p.fail("--low-precision-shard keep needs --precision bf16 (with fp32 the gather reads the master shard itself)");
  if (o.attention != "plain" && o.attention != "cudnn") p.fail("--attention must be plain or cudnn, got '" + o.attention + "'");
  if (o.attention_backward != "deterministic" && o.attention_backward != "nondeterministic")
    p.fail("--attention-backward must be deterministic or nondeterministic, got '" + o.attention_backward + "'");
  if (o.attention_backward != "deterministic" && o.attention != "cudnn")
    p.fail("--attention-backward chooses cuDNN's backward: it needs --attention cudnn (the plain kernels have one)");
  if (o.elementwise != "fused" && o.elementwise != "separate" && o.elementwise != "cublaslt")
    p.fail("--elementwise must be separate, fused or cublaslt, got '" + o.elementwise + "'");
  if (o.elementwise == "cublaslt" && o.precision != "bf16")
    p.fail("--elementwise cublaslt writes bf16 activations for bf16 products: it needs --precision bf16");
  if (o.device != "cuda" &&
      (o.comm_priority != "high" || o.device_timing != "on" || o.attention != "plain" || o.elementwise != "separate" || o.kernel_times))
    p.fail("--comm-priority, --device-timing, --kernel-times, --attention and --elementwise choose how the GPU runs: they need --device cuda");
  if (o.device == "cuda") {
    // What the GPU loop (gpt/cuda/train.cu) does not do: say so instead of ignoring the flag.
    auto host_only = [&](bool given, const std::string& flag) {
      if (given) p.fail("--device cuda: " + flag + " runs on the host program only (gpt/cuda/train.hpp)");
    };
    host_only(o.hosts > 1, "--hosts");
    host_only(r.auto_sharding.has_value(), "--sharding auto");
    host_only(o.bucket != "unit", "--bucket " + o.bucket);
    host_only(o.gather_dtype != "param", "--gather-dtype " + o.gather_dtype);
    host_only(o.offload, "--offload");
    host_only(o.reshard_to > 0, "--reshard-after-forward");
    host_only(r.micro_batches > 1, "--micro-batches");
    host_only(o.link_mbps > 0, "--link-*");
    host_only(!r.save_dir.empty() || !r.resume.empty() || !r.export_path.empty(), "--save/--resume/--export");
    host_only(!o.log_dir.empty(), "--log-dir");
  }
  return o;
}

std::string mib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", bytes / (1 << 20));
  return s;
}

// "[a b c d]" of one figure per rank.
template <class F>
std::string per_rank(const gpt::step_report& s, F figure) {
  std::string out = "[";
  for (std::size_t r = 0; r < s.ranks.size(); ++r) out.append(r ? " " : "").append(figure(s.ranks[r]));
  return out + "]";
}

void print_step(const gpt::step_report& s, int global_tokens) {
  char head[160];
  std::snprintf(head, sizeof head, "step %4d | loss %.4f | %7.0f tok/s", s.step, s.loss(), global_tokens / s.step_s());
  std::printf("%s | peak MiB %s | sent KiB %s | comm wait ms %s\n", head,
              per_rank(s, [](const gpt::rank_step& r) { return mib(static_cast<double>(r.peak)); }).c_str(),
              per_rank(s, [](const gpt::rank_step& r) { return std::to_string((r.sent + 512) / 1024); }).c_str(),
              per_rank(s, [](const gpt::rank_step& r) {
                char b[16];
                std::snprintf(b, sizeof b, "%.1f", r.wait_s * 1e3);
                return std::string(b);
              }).c_str());
  if (!std::isnan(s.ranks[0].val_loss)) std::printf("           validation loss %.4f\n", s.val_loss());
  std::fflush(stdout);
}

// ---- output files: checked before training starts, every write checked ---------------------

//! Prints "train_gpt: <msg>" and exits 2, as a bad option does (before any rank starts).
[[noreturn]] void refuse(const std::string& msg) {
  std::fprintf(stderr, "train_gpt: %s\n", msg.c_str());
  std::exit(2);
}

//! Refuses the run unless the directory `dir` (a flag's value; empty: not asked for) exists or
//! can be made, and a file can be made in it: checkpoints and logs go there during the run.
//! access(W_OK) is no test: it allows root almost anything, and /proc or /sys refuse root's
//! files all the same. So a probe file is made and removed (named by the process, since every
//! process of an MPI job checks).
void check_directory(const std::string& flag, const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) refuse(flag + " " + dir + ": cannot create the directory: " + ec.message());
  const std::string probe = (std::filesystem::path(dir) / (".train_gpt_probe_" + std::to_string(::getpid()))).string();
  errno = 0;
  std::FILE* f = std::fopen(probe.c_str(), "w");
  if (!f) refuse(flag + " " + dir + ": cannot create a file in the directory: " + std::strerror(errno));
  std::fclose(f);
  std::filesystem::remove(probe, ec);
}

//! Refuses the run unless `path` (a flag's value; empty: not asked for) can be opened for
//! writing. Leaves a file that exists as it was (opened to append, nothing written) and
//! removes one this check created: rank 0 writes the file later (the CSV from the first step
//! on, the plot and the trace at the end), and every process of an MPI job checks.
void check_writable(const std::string& flag, const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) refuse(flag + " " + path + ": is a directory");
  const bool existed = std::filesystem::exists(path, ec);
  errno = 0;
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f) refuse(flag + " " + path + ": cannot open for writing: " + std::strerror(errno));
  std::fclose(f);
  if (!existed) std::filesystem::remove(path, ec);
}

//! A file written from start to end. Every write is checked (check() after each piece, close()
//! at the end) and a failure throws naming the path, so that "wrote PATH" is printed only
//! after a good close.
class output_file {
 public:
  explicit output_file(std::string path) : path_(std::move(path)) {
    errno = 0;
    out_.open(path_, std::ios::binary | std::ios::trunc);
    if (!out_) fail("cannot open for writing");
  }
  std::ostream& stream() { return out_; }
  void check() {
    if (!out_) fail("cannot write");
  }
  void close() {
    out_.close();  // flushes
    if (!out_) fail("cannot write");
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    const int e = errno;
    throw std::runtime_error(std::string(what) + " " + path_ + (e != 0 ? std::string(": ") + std::strerror(e) : ""));
  }
  std::string path_;
  std::ofstream out_;
};

// ---- what rank 0 keeps of the run: bounded, whatever the number of steps ----------------------

//! A loss curve thinned to at most 2 * cap points: every stride-th value, the stride doubling
//! (and every other point dropped) when the points reach 2 * cap; the latest value is kept
//! apart, so the curve always reaches the last step.
class series {
 public:
  static constexpr std::size_t cap = 1024;
  struct point {
    int step;
    double value;
  };
  void add(int step, double value) {
    if (seen_++ % stride_ == 0) {
      points_.push_back({step, value});
      if (points_.size() >= 2 * cap) {
        std::size_t kept = 0;
        for (std::size_t i = 0; i < points_.size(); i += 2) points_[kept++] = points_[i];
        points_.resize(kept);
        stride_ *= 2;
      }
    }
    last_ = {step, value};
  }
  //! The kept points and the latest.
  template <class F>
  void for_each(F f) const {
    for (const auto& p : points_) f(p);
    if (!points_.empty() && points_.back().step != last_.step) f(last_);
  }

 private:
  std::vector<point> points_;
  std::size_t stride_ = 1, seen_ = 0;
  point last_{0, 0};
};

//! What the summary, the CSV and the plot need, fed a step at a time (on rank 0): running
//! figures, the CSV written a row per step as the steps finish, and the loss curves thinned
//! (class series). Opens the CSV at the first step: in on_step, whose failures stop every rank
//! together (gpt::callbacks).
class history {
 public:
  explicit history(const options& o) : csv_path_(o.loss_csv) {}

  void add(const gpt::step_report& s) {
    const bool has_val = !std::isnan(s.ranks[0].val_loss);
    if (steps_ == 0) {
      first_loss_ = s.loss(), peak_.assign(s.ranks.size(), 0);
      sent_.assign(s.ranks.size(), 0), sent_inter_host_.assign(s.ranks.size(), 0);
      if (!csv_path_.empty()) {
        csv_.emplace(csv_path_);
        // Round-trip precision: two runs' curves compare bit for bit (tests/gpt: threads = mpi).
        csv_->stream() << std::setprecision(std::numeric_limits<double>::max_digits10) << "step,train_loss,val_loss\n";
      }
    }
    ++steps_;
    for (std::size_t k = 0; k < s.ranks.size(); ++k) {
      peak_[k] = std::max(peak_[k], s.ranks[k].peak);
      sent_[k] += s.ranks[k].sent;
      sent_inter_host_[k] += s.ranks[k].sent_inter_host;
    }
    total_s_ += s.step_s();
    if (steps_ == 1) first_step_s_ = s.step_s();
    for (const auto& x : s.ranks) wait_s_ += x.wait_s / static_cast<double>(s.ranks.size());
    last_ = s;
    train_.add(s.step, s.loss());
    if (has_val) val_.add(s.step, s.val_loss());
    if (csv_) {
      auto& out = csv_->stream();
      out << s.step << ',' << s.loss() << ',';
      if (has_val) out << s.val_loss();
      out << '\n';
      out.flush();  // a row per finished step: a run that stops early leaves its curve so far
      csv_->check();
    }
  }

  //! Closes the CSV (throwing naming its path if any write failed) and says so.
  void finish_csv() {
    if (!csv_) return;
    csv_->close();
    csv_.reset();
    std::printf("wrote %s\n", csv_path_.c_str());
  }

  int steps() const { return steps_; }
  double first_loss() const { return first_loss_; }
  const gpt::step_report& last() const { return last_; }
  const std::vector<std::uint64_t>& peak() const { return peak_; }
  const std::vector<std::uint64_t>& sent() const { return sent_; }  //!< per rank, over the steps
  const std::vector<std::uint64_t>& sent_inter_host() const { return sent_inter_host_; }
  double total_s() const { return total_s_; }
  double wait_s() const { return wait_s_; }
  //! Tokens per second over every step, or over the steps after the first (the first warms up
  //! allocators, caches and, on a GPU, cuBLAS: 6-7x slower there, docs/gpu.md); with one step
  //! both are that step's.
  double tokens_per_s(double tokens_per_step, bool after_first = false) const {
    if (after_first && steps_ > 1) return tokens_per_step * (steps_ - 1) / (total_s_ - first_step_s_);
    return tokens_per_step * steps_ / total_s_;
  }
  const series& train() const { return train_; }
  const series& val() const { return val_; }

 private:
  int steps_ = 0;
  double first_loss_ = 0, total_s_ = 0, first_step_s_ = 0, wait_s_ = 0;
  std::vector<std::uint64_t> peak_, sent_, sent_inter_host_;
  gpt::step_report last_;
  series train_, val_;
  std::string csv_path_;
  std::optional<output_file> csv_;
};

// The loss curve as a self-contained SVG: training loss as a line, validation loss as dots.
void write_svg(const std::string& path, const history& h) {
  const double w = 720, h_px = 420, left = 60, right = 20, top = 30, bottom = 50;
  double lo = 1e30, hi = -1e30;
  auto extend = [&](const series::point& p) { lo = std::min(lo, p.value), hi = std::max(hi, p.value); };
  h.train().for_each(extend);
  h.val().for_each(extend);
  lo = std::floor(lo * 2) / 2, hi = std::ceil(hi * 2) / 2;
  if (hi <= lo) hi = lo + 1;
  const double last = std::max(1, h.last().step);
  auto x = [&](double step) { return left + (w - left - right) * step / last; };
  auto y = [&](double loss) { return top + (h_px - top - bottom) * (hi - loss) / (hi - lo); };
  output_file file(path);
  std::ostream& out = file.stream();
  out << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h_px << "' font-family='sans-serif' font-size='12'>\n"
      << "<rect width='100%' height='100%' fill='white'/>\n"
      << "<text x='" << left << "' y='18' font-size='14'>train_gpt loss (nats per byte)</text>\n";
  for (double v = lo; v <= hi + 1e-9; v += 0.5)  // horizontal grid every 0.5 nats
    out << "<line x1='" << left << "' x2='" << w - right << "' y1='" << y(v) << "' y2='" << y(v) << "' stroke='#ddd'/>"
        << "<text x='" << left - 8 << "' y='" << y(v) + 4 << "' text-anchor='end'>" << v << "</text>\n";
  for (int k = 0; k <= 4; ++k) {
    const int step = static_cast<int>(last * k / 4);
    out << "<text x='" << x(step) << "' y='" << h_px - bottom + 18 << "' text-anchor='middle'>" << step << "</text>\n";
  }
  out << "<text x='" << (w + left) / 2 << "' y='" << h_px - 10 << "' text-anchor='middle'>step</text>\n<polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='";
  h.train().for_each([&](const series::point& p) { out << x(p.step) << ',' << y(p.value) << ' '; });
  out << "'/>\n";
  h.val().for_each([&](const series::point& p) {
    out << "<circle cx='" << x(p.step) << "' cy='" << y(p.value) << "' r='3.5' fill='#ff7f0e'/>\n";
  });
  out << "<text x='" << w - right - 150 << "' y='" << top + 14 << "' fill='#1f77b4'>training</text>"
      << "<text x='" << w - right - 80 << "' y='" << top + 14 << "' fill='#ff7f0e'>validation</text>\n</svg>\n";
  file.close();
}

// What one rank holds without sharding: parameters and gradients in the parameter dtype, an
// fp32 master copy when that differs, and AdamW's two fp32 moments.
std::size_t unsharded_bytes(std::size_t numel, bool bf16) {
  return numel * (bf16 ? 2 + 2 + 4 : 4 + 4) + numel * 8;
}

void print_summary(const options& o, const history& h, std::size_t model_numel) {
  const gpt::step_report& last = h.last();
  const std::size_t n = last.ranks.size();
  const double tokens_per_step = static_cast<double>(o.run.batch) * o.run.model.seq;
  const std::size_t full = unsharded_bytes(model_numel, o.precision == "bf16");
  char val[48] = "";
  if (!std::isnan(last.ranks[0].val_loss)) std::snprintf(val, sizeof val, ", validation %.4f", last.val_loss());
  std::printf("\nloss %.4f -> %.4f (train)%s; %zu parameters; %.0f tokens/s; %.1f%% of step time waiting on communication\n",
              h.first_loss(), last.loss(), val, model_numel, h.tokens_per_s(tokens_per_step), 100 * h.wait_s() / h.total_s());
  if (h.steps() > 1) std::printf("after the first step (warm-up): %.0f tokens/s\n", h.tokens_per_s(tokens_per_step, true));
  std::printf("\nper-rank memory (MiB)   sharded state   peak (with gathered units)   unsharded (DDP) needs\n");
  for (std::size_t k = 0; k < n; ++k)
    std::printf("  rank %-4zu             %13s   %26s   %21s\n", k, mib(static_cast<double>(last.ranks[k].persistent)).c_str(),
                mib(static_cast<double>(h.peak()[k])).c_str(), mib(static_cast<double>(full)).c_str());
  std::printf("(model state only: parameters, gradients, AdamW moments; activations are the engine's own)\n");
  if (o.offload) std::printf("(--offload: the sharded state is in host memory, outside these device figures)\n");
  auto bytes = [](const std::vector<std::uint64_t>& v) {
    std::string out;
    for (std::uint64_t b : v) out.append(out.empty() ? "" : " ").append(std::to_string(b));
    return out;
  };
  std::printf("\nbytes sent per rank over the steps: [%s]; to other hosts: [%s]\n", bytes(h.sent()).c_str(),
              bytes(h.sent_inter_host()).c_str());
}

// Writes what was asked for, on rank 0 ("wrote" once each file is closed).
void write_outputs(const options& o, history& h, const std::vector<std::string>& events) {
  h.finish_csv();
  if (!o.loss_plot.empty()) write_svg(o.loss_plot, h), std::printf("wrote %s\n", o.loss_plot.c_str());
  if (!o.trace.empty()) {
    std::string joined;
    for (const auto& e : events)
      if (!e.empty()) joined.append(joined.empty() ? "" : ",\n").append(e);
    output_file file(o.trace);
    file.stream() << fsdp::timeline::chrome_document(joined);
    file.close();
    std::printf("wrote %s (open in ui.perfetto.dev or chrome://tracing)\n", o.trace.c_str());
  }
}

// The header line's precision: bf16 says where the gathered bf16 shard comes from.
std::string precision_label(const options& o) {
  if (o.precision != "bf16") return o.precision;
  return o.low_precision_shard == "keep" ? "bf16 (bf16 shard kept, written by AdamW)" : "bf16 (cast at each gather)";
}

// One rank: train (rank 0 keeps the history as the steps come), then rank 0 reports.
template <class Group>
void run_rank(typename Group::comm_type& comm, const options& o, const gpt::corpus& text, fsdp::timeline::clock::time_point epoch) {
  typename Group::options opts{.sharding = o.shards, .prefetch = {.forward = o.prefetch, .backward = o.prefetch}};
  opts.keep_low_precision_shard = o.low_precision_shard == "keep";
  if constexpr (std::is_same_v<typename Group::bucket_type, fsdp::fixed_bytes>) opts.bucket.bytes = o.bucket_bytes;
  if (o.offload) opts.offload = fsdp::offload_all();
  if constexpr (std::is_same_v<typename Group::queue_type, fsdp::host_queue>) {
    if (o.gather_dtype == "int8") opts.collectives.all_gather = fsdp::int8_all_gather{};
    if (o.gather_dtype == "fp8") opts.collectives.all_gather = fsdp::fp8_all_gather{};
  }
  fsdp::timeline tl(epoch);
  const int tokens = o.run.batch * o.run.model.seq;
  std::optional<history> h;
  if (comm.rank() == 0) h.emplace(o);
  const gpt::run_result r = gpt::train_rank<Group>(comm, o.run, opts, text,
                                                   {.on_step =
                                                        [&](const gpt::step_report& s) {
                                                          print_step(s, tokens);
                                                          std::fflush(stdout);  // a line per step, into a log or a pipe too
                                                          h->add(s);
                                                        },
                                                    .on_note = [](const std::string& note) { std::fputs(note.c_str(), stdout); },
                                                    .timeline = o.trace.empty() ? nullptr : &tl,
                                                    .keep_steps = false});
  if (r.stopped_by != 0) stopped_by = r.stopped_by;
  const std::vector<std::string> events = o.trace.empty() ? std::vector<std::string>{} : gpt::gather_strings(comm, r.events);
  if (comm.rank() != 0) return;
  print_summary(o, *h, r.model_numel);
  write_outputs(o, *h, events);
}

// The group's type holds what changes code: the precision, the bucket policy (fixed_bytes for
// --bucket BYTES; else per_unit, which auto's plan needs) and the communicator. The sharding,
// the prefetch depths and auto's plan are values in its options.
template <class Precision, class Comm>
void train_with(Comm& comm, const options& o, const gpt::corpus& text, fsdp::timeline::clock::time_point epoch) {
  using P = typename Precision::param_type;
  if (o.bucket_bytes > 0)
    run_rank<fsdp::shard_group<fsdp::buffer<P>, Precision, fsdp::fixed_bytes, Comm>>(comm, o, text, epoch);
  else
    run_rank<fsdp::shard_group<fsdp::buffer<P>, Precision, Comm>>(comm, o, text, epoch);
}

std::string with_commas(double x);

// --tp, --pp, --recompute: one rank of the GPT on a device mesh (gpt/parallel.hpp). Rank 0
// prints each step, then every rank's traffic per mesh dimension and its peak memory.
template <class Group>
void run_mesh_rank(typename Group::comm_type& comm, const options& o, const gpt::corpus& text) {
  typename Group::options opts{.sharding = o.shards, .prefetch = {.forward = o.prefetch, .backward = o.prefetch}};
  opts.keep_low_precision_shard = o.low_precision_shard == "keep";
  if (o.offload) opts.offload = fsdp::offload_all();
  gpt::parallel_options p = o.mesh;
  const int dp = comm.size() / (p.mesh.tp * p.mesh.pp);
  p.mesh.dp_shard = dp;
  if (o.shards.shard_size > 0 && o.shards.shard_size < dp) {  // --sharding hybrid:S: the mesh dp_replicate x dp_shard
    p.mesh.dp_shard = o.shards.shard_size;
    p.mesh.dp_replicate = dp / o.shards.shard_size;
  }
  const int tokens = o.run.batch * o.run.model.seq;
  auto last = std::chrono::steady_clock::now();
  std::optional<output_file> csv;  // rank 0: as history's, without validation losses
  if (comm.rank() == 0 && !o.loss_csv.empty()) {
    csv.emplace(o.loss_csv);
    csv->stream() << std::setprecision(std::numeric_limits<double>::max_digits10) << "step,train_loss,val_loss\n";
  }
  const gpt::parallel_result r = gpt::train_parallel<Group>(comm, o.run, p, opts, text, [&](const gpt::parallel_step& s) {
    const auto now = std::chrono::steady_clock::now();
    const double took = std::chrono::duration<double>(now - last).count();
    last = now;
    if (comm.rank() != 0) return;
    std::printf("step %4d | loss %.4f | %7.0f tok/s | grad norm %.4f\n", s.step, s.loss, tokens / took, s.grad_norm);
    std::fflush(stdout);
    if (csv) csv->stream() << s.step << ',' << s.loss << ",\n", csv->check();
  });
  if (csv) csv->close(), std::printf("wrote %s\n", o.loss_csv.c_str());
  // Per rank: bytes sent per step along dp, tp and pp, and the peak of fsdp-managed memory.
  const auto steps = static_cast<std::uint64_t>(o.run.steps);
  // dp: the dense shard_group's and the experts'; ep: the experts' all-to-alls.
  constexpr std::size_t n = 5;
  const std::uint64_t mine[n] = {(r.dp.total() + r.expert_dp.total()) / steps, r.tp.total() / steps, r.pp.total() / steps,
                                 r.ep.total() / steps, r.peak_bytes};
  std::vector<std::uint64_t> all(n * static_cast<std::size_t>(comm.size()));
  fsdp::host_queue q;
  comm.all_gather(mine, all.data(), n, fsdp::dtype::i64, q).wait(comm.timeout());
  if (comm.rank() != 0) return;
  std::printf("\nmesh %s; bytes sent per step (dp | tp | pp | ep) and peak fsdp memory per rank:\n", fsdp::to_string(p.mesh).c_str());
  for (int k = 0; k < comm.size(); ++k) {
    const std::uint64_t* f = &all[n * static_cast<std::size_t>(k)];
    std::printf("  rank %2d: %s | %s | %s | %s bytes, peak %s MiB\n", k, with_commas(static_cast<double>(f[0])).c_str(),
                with_commas(static_cast<double>(f[1])).c_str(), with_commas(static_cast<double>(f[2])).c_str(),
                with_commas(static_cast<double>(f[3])).c_str(), mib(static_cast<double>(f[4])).c_str());
  }
}

// One rank, on either backend. Thread ranks share `epoch`; processes take theirs together.
template <class Comm>
void train(Comm& comm, const options& o, const gpt::corpus& text, fsdp::timeline::clock::time_point epoch) {
  if constexpr (!std::is_same_v<Comm, fsdp::threads::communicator>) {
    comm.barrier();  // processes start their clocks together (one host: one monotonic clock)
    epoch = fsdp::timeline::clock::now();
  }
  const fsdp::topology hosts = fsdp::topology_of(comm);
  const bool uneven = o.shards.shard_size == fsdp::sharding::per_host && hosts.ranks_per_host() == 0;  // refused below
  if (comm.rank() == 0 && hosts.hosts() > 1) {
    std::printf("hosts: %s", hosts.str().c_str());
    if (!uneven && !o.run.auto_sharding) {  // auto says what it chose once it has measured
      const int s = o.shards.shard_group_size(comm.size(), hosts.ranks_per_host());
      std::printf("; shard groups of %d ranks (%s), %d replicas", s, o.sharding.c_str(), comm.size() / s);
    }
    std::printf("\n\n");
    std::fflush(stdout);
  }
  using bf16_group = fsdp::shard_group<fsdp::buffer<fsdp::bf16>, fsdp::mixed_precision<fsdp::bf16, float, float>, Comm>;
  using f32_group = fsdp::shard_group<fsdp::buffer<float>, fsdp::full_precision<float>, Comm>;
  if (o.on_mesh())
    o.precision == "bf16" ? run_mesh_rank<bf16_group>(comm, o, text) : run_mesh_rank<f32_group>(comm, o, text);
  else if (o.precision == "bf16")
    train_with<fsdp::mixed_precision<fsdp::bf16, float, float>>(comm, o, text, epoch);
  else
    train_with<fsdp::full_precision<float>>(comm, o, text, epoch);
}

// ---- the size check: refuse a model too big for the machine, before allocating it -----------

//! The first of the environment variables `names` that holds a positive integer, else `fallback`.
int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names)
    if (const char* v = std::getenv(n); v != nullptr && std::atoi(v) > 0) return std::atoi(v);
  return fallback;
}

//! "206,158,430,208".
std::string with_commas(double x) {
  std::string digits = std::to_string(static_cast<unsigned long long>(std::llround(x))), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

//! What the run needs on this machine and what the machine has.
struct fit {
  gpt::memory_need need;
  gpt::memory_available have;
  int ranks_here = 1;
};

//! Estimates the memory the run needs on this machine (every thread rank is here; with mpi,
//! the processes mpiexec says are on this host) and refuses the run (exit 2) when that exceeds
//! what the machine has available.
fit check_size(const options& o) {
  const bool mpi = o.backend == "mpi";
  const int ranks = mpi ? env_int({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1) : o.ranks;
  fit f;
  f.ranks_here = mpi ? env_int({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}, 1) : o.ranks;
  const int per_host = mpi ? f.ranks_here : o.ranks / o.hosts;
  f.need = gpt::estimate_memory(o.run, {.ranks = ranks,
                                        .ranks_here = f.ranks_here,
                                        .shard_size = o.shards.shard_group_size(ranks, per_host),
                                        .reshard_after_forward = o.shards.reshard_after_forward,
                                        .prefetch = o.prefetch,
                                        .bf16 = o.precision == "bf16"});
  f.have = gpt::available_memory();
  if (f.have.bytes <= 0 || f.need.total <= f.have.bytes) return f;
  const auto& m = o.run.model;
  refuse("the model is too big for this machine: " + with_commas(f.need.params) + " parameters (--layers " +
         std::to_string(m.layers) + ", --dim " + std::to_string(m.dim) + ") need about " + gpt::human_bytes(f.need.total) +
         (f.ranks_here > 1 ? " (" + std::to_string(f.ranks_here) + " ranks here, " + gpt::human_bytes(f.need.per_rank) + " each)" : "") +
         " but " + gpt::human_bytes(f.have.bytes) + " is available (" + f.have.source +
         "); per rank: the model as built, before sharding (" + gpt::human_bytes(f.need.model_copy) +
         "), sharded parameters, gradients and AdamW moments (" + gpt::human_bytes(f.need.state) +
         "), gathered units and activations (" + gpt::human_bytes(f.need.gathered + f.need.activations) + ")");
}

//! Refuses the run when --save's filesystem has no room for one checkpoint: every parameter's
//! f32 value and AdamW's two f32 moments, 12 bytes a parameter (frozen ones have no moments:
//! an upper bound; headers and padding add a few per cent). Only one: each save writes another and none is removed, but how many the
//! run writes depends on --resume's step, and old ones may be deleted while it runs.
void check_save_space(const options& o) {
  if (o.run.save_dir.empty()) return;
  const double params = gpt::parameter_count(o.run.model), need = params * 12;
  std::error_code ec;
  const std::filesystem::space_info s = std::filesystem::space(o.run.save_dir, ec);
  if (ec || need <= static_cast<double>(s.available)) return;
  refuse("--save " + o.run.save_dir + ": a checkpoint of this run needs about " + gpt::human_bytes(need) + " (" +
         with_commas(params) + " parameters, 12 bytes each: f32 values and AdamW's two moments) but " +
         gpt::human_bytes(static_cast<double>(s.available)) + " is available there");
}

void banner(const options& o, int ranks, const char* ranks_kind, const gpt::corpus& text, const fit& f) {
  const auto& m = o.run.model;
  const std::string matmul = o.matmul == "blas" ? "blas (" + gpt::blas_name() + ")" : o.matmul;
  std::printf("train_gpt: %d %s, sharding %s, precision %s, prefetch %d, bucket %s, matmul %s, gather %s\n", ranks, ranks_kind,
              o.sharding.c_str(), precision_label(o).c_str(), o.prefetch, o.bucket.c_str(), matmul.c_str(), o.gather_dtype.c_str());
  if (!o.run.freeze.empty()) {
    std::string names;
    for (const std::string& f : o.run.freeze) names.append(names.empty() ? "" : ",").append(f);
    std::printf("frozen: %s (no gradient, no reduction, no optimizer state)\n", names.c_str());
  }
  if (o.offload) std::printf("offload: every bucket's sharded state in host memory (not in the peak figures)\n");
  if (o.reshard_to > 0)
    std::printf("hpZ: reshard after forward to %d ranks (backward gathers inside each run of %d)\n", o.reshard_to, o.reshard_to);
  if (o.on_mesh())
    std::printf("mesh: tp %d x pp %d (%s schedule) x data parallel; recompute %s", o.mesh.mesh.tp, o.mesh.mesh.pp,
                o.schedule.c_str(), o.mesh.recompute ? "on" : "off");
  if (o.run.model.experts > 0)
    std::printf("; %d experts, top %d, over ep %d", o.run.model.experts, o.run.model.top_k, o.mesh.mesh.ep);
  if (o.on_mesh()) std::printf("\n");
  if (o.run.micro_batches > 1)
    std::printf("micro-batches: %d per step, reduced %s\n", o.run.micro_batches,
                o.run.reduce_each_micro_batch ? "after each (replicas all-reduce after the last)" : "after the last");
  if (o.link_mbps > 0) std::printf("link model: %.3g ms latency, %.4g MB/s per rank\n", o.link_latency_ms, o.link_mbps);
  std::printf("model: %d layers, dim %d, %d heads, context %d bytes; global batch %d sequences; %d steps, AdamW lr %g\n", m.layers,
              m.dim, m.heads, m.seq, o.run.batch, o.run.steps, static_cast<double>(o.run.lr));
  std::printf("memory: about %s needed on this machine (estimated), %s available (%s)\n", gpt::human_bytes(f.need.total).c_str(),
              gpt::human_bytes(f.have.bytes).c_str(), f.have.source.c_str());
  std::printf("data: %s (%zu bytes: %zu train, %zu validation)\n\n", text.name.c_str(), text.text.size(), text.train_end,
              text.text.size() - text.train_end);
  std::fflush(stdout);
}

// --device cuda --backend nccl, before any rank starts: one clear error without NCCL or a GPU.
void check_nccl_run() {
  if (!gpt::cuda::have_nccl)
    throw fsdp::error(fsdp::errc::no_device, "--backend nccl: this train_gpt_cuda was built without NCCL (CMake found no libnccl "
                                             "and nccl.h); --backend threads runs the ranks as threads");
  gpt::cuda::check_device();
}

// --device cuda --backend nccl, the launcher: --ranks processes of this program (argv as given)
// on GPU 0, each one NCCL rank. example::spawn_process_ranks gives each its own NCCL_HOSTID, as
// NCCL 2.28 refuses two ranks of one communicator on one GPU otherwise (common/process_ranks.hpp;
// --nccl-ranks threads runs them in this process instead, with NCCL 2.30 or later).
// Rank 0 prints the report; this process prints nothing of its own unless a rank failed, and
// then fails naming it (each rank has printed its own error on stderr, prefixed with its rank).
int launch_nccl_ranks(const options& o, char** argv) {
  check_nccl_run();
  std::vector<std::string> args;
  for (char** a = argv + 1; *a != nullptr; ++a) args.emplace_back(*a);
  std::fflush(stdout);  // the ranks write to the same stdout
  // A run's length is not bounded (the thread ranks' is not either); every wait inside a rank
  // is, by the communicator's timeout, so a stuck rank fails on its own, and once one has failed
  // the others get spawn_options::grace to see it (shard_group aborts the communicator) before
  // they are killed.
  const std::vector<example::rank_exit> exits =
      example::spawn_process_ranks({.ranks = o.ranks, .args = args, .timeout = std::chrono::hours(24 * 7)});
  // The ranks that failed on their own; when there are none, those the launcher killed.
  auto ranks_where = [&](auto pred) {
    std::string s;
    for (std::size_t r = 0; r < exits.size(); ++r)
      if (pred(exits[r])) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  };
  std::string failed = ranks_where([](const example::rank_exit& e) { return !e.ok() && !e.killed; });
  if (failed.empty()) failed = ranks_where([](const example::rank_exit& e) { return !e.ok(); });
  if (!failed.empty())
    throw fsdp::error(fsdp::errc::peer_failure, std::string("--backend nccl: ") + (failed.find(',') == std::string::npos ? "rank " : "ranks ") +
                                                    failed + " failed (" + example::describe(exits) + ")");
  return 0;
}

// --device cuda: the same model, data and report on GPU 0, over thread ranks or NCCL processes
// (gpt/cuda/train.hpp). train_gpt itself has no CUDA code: it hands the run to train_gpt_cuda,
// built beside it when the build has CUDA (examples/CMakeLists.txt says why).
int run_cuda(const options& o, char** argv) {
  if (!gpt::cuda::available) {
    std::error_code ec;
    const std::filesystem::path cuda = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "train_gpt_cuda";
    if (ec || !std::filesystem::exists(cuda))
      throw fsdp::error(fsdp::errc::no_device, "--device cuda: no train_gpt_cuda beside this train_gpt (build that target; "
                                               "it exists where CMake found nvcc, or with -DFSDP_CUDA=ON)");
    std::fflush(stdout);
    execv(cuda.c_str(), argv);
    throw fsdp::error(fsdp::errc::no_device, "--device cuda: cannot start " + cuda.string() + ": " + std::strerror(errno));
  }
  const bool nccl = o.backend == "nccl", nccl_threads = nccl && o.nccl_ranks == "threads";
  const std::optional<example::process_rank> me = nccl && !nccl_threads ? example::this_process_rank() : std::nullopt;
  // --backend nccl: rank 0 reports; the other ranks print nothing but their errors (stderr).
  const bool reporter = !me || me->rank == 0;
  if (reporter) {
    check_writable("--trace", o.trace);
    check_writable("--loss-csv", o.loss_csv);
    check_writable("--loss-plot", o.loss_plot);
  }
  if (nccl && !nccl_threads && !me) return launch_nccl_ranks(o, argv);
  if (nccl_threads) {
    // Before CUDA starts (it reads this once): thread ranks need every kernel loaded up front
    // (common/nccl_thread_ranks.hpp says why; an explicit other value is refused there, by name).
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    check_nccl_run();
  }
  const gpt::corpus text = gpt::load_corpus(o.data, o.run.model.seq);
  const auto& m = o.run.model;
  if (reporter) {
    if (nccl)
      std::printf("train_gpt: %d NCCL ranks (%s) on GPU 0 (--device cuda --backend nccl, NCCL %s, %s buffers), sharding %s, "
                  "precision %s, prefetch %d, matmul cublas\n",
                  o.ranks, o.nccl_ranks.c_str(), gpt::cuda::nccl_version().c_str(), o.nccl_buffers.c_str(), o.sharding.c_str(),
                  precision_label(o).c_str(), o.prefetch);
    else
      std::printf("train_gpt: %d thread ranks on GPU 0 (--device cuda), sharding %s, precision %s, prefetch %d, matmul cublas\n",
                  o.ranks, o.sharding.c_str(), precision_label(o).c_str(), o.prefetch);
    std::printf("streams: collectives at %s priority; device timing %s (comm wait: %s)\n", o.comm_priority.c_str(),
                o.device_timing.c_str(), o.device_timing == "on" ? "the GPU's stall on communication" : "host waits");
    std::printf("kernels: attention %s; recompute %s; elementwise %s\n",
                o.attention != "cudnn"                        ? "plain (T x T scores, f32)"
                : o.attention_backward == "deterministic" ? "cudnn (fused, bf16, deterministic backward)"
                                                          : "cudnn (fused, bf16, nondeterministic backward)", o.mesh.recompute ? "on" : "off",
                o.elementwise == "fused"      ? "fused (bias epilogues, bf16 operands from their producers)"
                : o.elementwise == "cublaslt" ? "cublaslt (fused, the products' bias, GELU and residual in cuBLASLt's epilogues)"
                                              : "separate passes");
    std::printf("model: %d layers, dim %d, %d heads, context %d bytes; global batch %d sequences; %d steps, AdamW lr %g\n", m.layers,
                m.dim, m.heads, m.seq, o.run.batch, o.run.steps, static_cast<double>(o.run.lr));
    std::printf("data: %s (%zu bytes: %zu train, %zu validation)\n\n", text.name.c_str(), text.text.size(), text.train_end,
                text.text.size() - text.train_end);
    std::fflush(stdout);
  }
  history h(o);
  const int tokens = o.run.batch * o.run.model.seq;
  const gpt::cuda::result r = gpt::cuda::train({.run = o.run,
                                                .ranks = o.ranks,
                                                .comm = nccl_threads ? gpt::cuda::backend::nccl_threads
                                                        : nccl       ? gpt::cuda::backend::nccl
                                                                     : gpt::cuda::backend::threads,
                                                .process = me.value_or(example::process_rank{}),
                                                .shards = o.shards,
                                                .bf16 = o.precision == "bf16",
                                                .prefetch = o.prefetch,
                                                .comm_high_priority = o.comm_priority == "high",
                                                .time_on_device = o.device_timing == "on",
                                                .cudnn_attention = o.attention == "cudnn",
                                                .deterministic_attention = o.attention_backward == "deterministic",
                                                .recompute = o.mesh.recompute,
                                                .fused_elementwise = o.elementwise != "separate",
                                                .cublaslt_epilogues = o.elementwise == "cublaslt",
                                                .keep_low_precision_shard = o.low_precision_shard == "keep",
                                                .kernel_times = o.kernel_times,
                                                .registered_buffers = o.nccl_buffers == "registered"},
                                               text, {.on_step = [&](const gpt::step_report& s) {
                                                        print_step(s, tokens);
                                                        h.add(s);
                                                      },
                                                      .trace = !o.trace.empty()});
  if (!reporter) return 0;
  print_summary(o, h, r.model_numel);
  // Model FLOPs utilisation as the field quotes it: 6 N flops per token (forward and backward of
  // the matrix products, attention's own left out), against the H100's 989 TFLOP/s dense bf16,
  // at the throughput after the first step (cuBLAS's warm-up is not the model's speed). Beside it
  // llm.c's count (gpt2_estimate_mfu): 6 N + 6 L C T per token, the second term the attention's
  // products (PaLM's appendix B counts 12 L C T for them, without a causal mask).
  const double tokens_per_s = h.tokens_per_s(tokens, true);
  const double n = static_cast<double>(r.model_numel), attention_flops = 6.0 * m.layers * m.dim * m.seq;
  std::printf("model FLOPs utilisation: %.1f%% of 989 TFLOP/s (6 x %zu parameters x %.0f tokens/s); llm.c's count "
              "(6 N + 6 L C T a token): %.1f%%\n",
              100 * 6.0 * n * tokens_per_s / 989e12, r.model_numel, tokens_per_s, 100 * (6.0 * n + attention_flops) * tokens_per_s / 989e12);
  std::printf("attention: %s; activations %s MiB per rank\n", r.attention.c_str(), mib(static_cast<double>(r.activation_bytes)).c_str());
  // Registered memory is held in blocks (use_memory): per-rank peaks above count live buffers only.
  if (r.source_blocks > 0)
    std::printf("registered memory (rank 0): %zu blocks, %s MiB asked (ncclMemAlloc rounds each up to its granule: 2 MiB on current GPUs)\n",
                r.source_blocks, mib(static_cast<double>(r.source_bytes)).c_str());
  if (!r.kernel_times.empty()) std::printf("%s", r.kernel_times.c_str());
  write_outputs(o, h, r.events);
  return 0;
}

// The host run: everything but --device cuda. A template only so that train_gpt_cuda, which
// never runs it (train_gpt hands it --device cuda runs alone), does not compile the host paths'
// trainers a second time (about 100 s of the test build on 2 cores).
template <int = 0>
int run_host(const options& o, int argc, char** argv) {
  if (o.backend == "nccl") {
    // The model's kernels in this program are host loops; NCCL moves device memory. Say so
    // plainly instead of failing somewhere inside.
    throw fsdp::error(fsdp::errc::no_device,
                      "--backend nccl: this program computes on the host; NCCL needs the model on the GPU: "
                      "--device cuda --backend nccl (see docs/gpu.md)");
  }
  // Before anything is allocated or trained: the output files can be written, the model fits.
  check_writable("--trace", o.trace);
  check_writable("--loss-csv", o.loss_csv);
  check_writable("--loss-plot", o.loss_plot);
  check_writable("--export", o.run.export_path);
  check_directory("--save", o.run.save_dir);
  check_save_space(o);
  check_directory("--log-dir", o.log_dir);
  const fit f = check_size(o);
  if (o.matmul == "blas") {
    // The limit is per process: its ranks (threads), each with its two collective queues; MPI
    // adds its engine and Open MPI's own threads (about 4 per process in all).
    const int here = o.backend == "mpi" ? 1 : f.ranks_here;
    const auto as = gpt::address_space_needed(f.need.per_rank * here, 4 * here + 4, here + 1);
    if (as.need > as.limit && as.limit > 0)
      refuse("--matmul blas under an address-space limit (ulimit -v) of " + gpt::human_bytes(as.limit) + ": this run maps about " +
             gpt::human_bytes(as.need) + " (the model, thread stacks, malloc arenas and OpenBLAS's buffers), and OpenBLAS hangs "
             "when it cannot map its buffers; raise the limit or use --matmul loops");
    gpt::enable_blas();
  }
  const gpt::corpus text = gpt::load_corpus(o.data, o.run.model.seq);
  const example::launch_options where{
      .backend = o.backend,
      .ranks = o.ranks,
      .world = {.link = {.alpha_s = o.link_latency_ms * 1e-3, .beta_bytes_per_s = o.link_mbps * 1e6},
                .ranks_per_host = o.ranks / o.hosts},
      .log_dir = o.log_dir};
  const auto epoch = fsdp::timeline::clock::now();  // one clock for every thread rank
  const fsdp::stop_signals stop;                    // preemption: a checkpoint, then exit 128 + signal
  example::launch(
      argc, argv, where, [&](int ranks, const char* kind) { banner(o, ranks, kind, text, f); },
      [&](auto& comm) { train(comm, o, text, epoch); });
  return stopped_by != 0 ? fsdp::stop_signals::exit_status(stopped_by) : 0;
}

// Runs the job; exceptions leave through it (main turns them into one line and exit 1).
int run(int argc, char** argv) {
  const options o = parse(argc, argv);
  if (o.device == "cuda") return run_cuda(o, argv);
  if constexpr (gpt::cuda::available)
    throw fsdp::error(fsdp::errc::invalid_argument, "train_gpt_cuda runs --device cuda only: run train_gpt beside it");
  else
    return run_host(o, argc, argv);
}

//! The exception being handled, in one line.
std::string what_failed() {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return "out of memory (std::bad_alloc): try a smaller --dim, --layers, --batch or --seq, or fewer --ranks";
  } catch (const std::system_error& e) {
    if (e.code() == std::errc::resource_unavailable_try_again)  // what std::thread throws
      return std::string("out of resources: could not start a thread (") + e.what() + "): try fewer --ranks";
    return e.what();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "stopped by an exception of unknown type";
  }
}

}  // namespace

// Every failure ends in one line on stderr, "train_gpt: <what>", and exit 1 (bad options and a
// model too big for the machine: exit 2, before anything runs). fsdp::error's what() names
// the rank and the unit where it knows them.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (...) {
    const std::string what = what_failed();
    std::fflush(stdout);  // what was printed so far comes first
    // A rank that --device cuda --backend nccl started says which it is: they share stderr.
    const char* rank = std::getenv("FSDP_PROCESS_RANK");
    std::fprintf(stderr, "train_gpt: %s%s%s%s\n", rank ? "rank " : "", rank ? rank : "", rank ? ": " : "", what.c_str());
    return 1;
  }
}
