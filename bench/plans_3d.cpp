// `fsdp_bench plans --3d`: 3-D configurations on paper. For Llama 3 70B and 405B on 64 to 512
// H100s it prices every TP t x PP p x FSDP d (t in 1, 2, 4, 8; p in 1, 2, 4, 8, 16; d = ranks /
// (t p)) at a fixed global batch, and prints per configuration the memory per rank, the step
// time, tokens/s per GPU and MFU, the fastest configuration that fits 80 GB marked, then the
// published configurations (Llama 3 paper, torchtitan) beside the model's rows.
//
//   fsdp_bench plans --3d                          70B and 405B at 64, 128, 256, 512 H100s
//   fsdp_bench plans --3d --model 405b --ranks 512 --global-batch 256
//   fsdp_bench plans --3d --help
//
// The model, per rank, and what it approximates:
//  * Layout: TP innermost (a TP group is t consecutive ranks, inside one 8-GPU node), then DP,
//    then PP. FSDP full-shards over the DP group (d ranks at stride t; HSDP is not enumerated).
//  * Stage: ceil(layers / p) blocks plus norm + output (the last stage, whose output projection
//    makes it the heaviest; p = 1 adds the token embedding). Each weight matrix is sliced 1/t
//    Megatron-style (wq, wk, wv, w1, w3 column-parallel, wo, w2 row-parallel); embedding and
//    output are vocabulary-parallel (as torchtitan's loss_parallel); norms are replicated.
//  * FSDP on the DP group: the existing simulator (schedule/simulator.hpp) runs that stage's
//    TP-sliced units with FSDP2's per-unit plan, priced by h100_strided(d, t): with t = 8 each
//    DP member is on its own node and rings through its own 400 Gb/s NIC.
//      p = 1: the local batch runs as m gradient-accumulation passes of b sequences; FSDP2
//             gathers and reduce-scatters in every pass (reshard after forward), so the pass
//             is simulated once and counted m times, plus one optimizer step.
//      p > 1: 1F1B over m micro-batches; as torchtitan runs FSDP under PP, the stage is gathered
//             once and kept (no reshard after forward) and gradients are reduce-scattered after
//             the last micro-batch, kept unsharded in bf16 until then. Simulated as one pass
//             whose unit times are the m micro-batches' sum; plus the bubble (p - 1) x (one
//             micro-batch's forward + backward), i.e. the fraction (p - 1) / (m + p - 1) of the
//             pipeline's time, plus the point-to-point sends: each micro-batch's activation
//             forward and its gradient back (b s h 2 / t bytes with sequence parallelism) over
//             one NIC, (m + p - 1) of each counted exposed.
//  * TP communication: per block and micro-batch 2 all-reduces forward and 2 backward of the
//    activation (b s h 2 bytes; with sequence parallelism an all-gather plus a reduce-scatter,
//    the same bytes), 2 more when the forward is recomputed, on NVLink (h100_nvlink(t)'s
//    all-reduce), all exposed: async TP's overlap is not modelled.
//  * Compute: the FLOPs of bench/plans.cpp (2 P per token forward per matrix, 4 P backward,
//    PaLM's attention term) divided by t, at --tflops x --mfu; full activation recomputation
//    adds a block's forward to its backward.
//  * Memory: FSDP's peak from the simulator (f32 master, grad shard and AdamW moments, 16 bytes
//    per sharded element, plus the gathered bf16 transient), + (p > 1) the stage's unsharded
//    bf16 gradients, + activations of the micro-batches in flight (1 for p = 1; min(p, m), the
//    first stage's 1F1B count, for p > 1), + the output's f32 logits and their gradient
//    (b s vocab / t x 8 bytes). Activations per block and micro-batch (Korthikanti et al. 2022,
//    "Reducing Activation Recomputation in Large Transformer Models", eq. for TP + sequence
//    parallelism: s b h (34 + 5 a s / h) / t bytes; the 5 a s / h term is the attention matrix,
//    which flash attention never stores, so s b h 34 / t): without recomputation all blocks of
//    the stage keep that; with full recomputation (AC full) each keeps its input, s b h 2 / t,
//    and one block's 34-term is live during its backward. Peaks are added, an upper estimate;
//    no allocator fragmentation, CUDA context or NCCL buffers. "fits" means <= 80 GB.
// Each row of the table is the fastest fitting choice of micro-batch size b (a power of 2) and
// AC (full or none) for its (TP, PP); where none fits, the least memory. Step times are per
// global batch; tokens/s per GPU and MFU (model FLOPs, recomputation excluded, over 989 TFLOPS)
// follow from them, so MFU sits below --mfu by construction.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "fsdp/schedule/trace.hpp"
#include "plans.hpp"

namespace {

using namespace fsdp::schedule;
using namespace fsdp_bench_plans;

// Sequence length 8192: the Llama 3 paper's pre-training length for 405B (Table 4) and
// torchtitan's 70B and 405B recipes' seq_len.
constexpr int default_seq = 8192;
// Global batch in sequences of 8192. 405B: 16M tokens (Llama 3 paper, Table 4 and sec. 3.4.1:
// the batch grows to 16M tokens). 70B: the paper gives no 70B parallel setup; 512 sequences
// (4M tokens) is torchtitan's 70B benchmark (benchmarks/llama3_h100_202412_torchtitan.md,
// Table 4: 256 H100, local batch 16, global batch 512).
constexpr int batch_70b = 512;
constexpr int batch_405b = 2048;
// Activation bytes per token and hidden unit of a block with TP + sequence parallelism, flash
// attention (Korthikanti et al. 2022, Table 2's 34 + 5 a s / h without the attention matrix).
constexpr double act_bytes_per_sh = 34;
// The output's f32 logits and their gradient (4 + 4 bytes per logit).
constexpr double logit_bytes = 8;

struct model_entry {
  llama_shape shape;
  int global_batch;  // sequences
};

struct options {
  std::vector<model_entry> models{{llama3_70b, batch_70b}, {llama3_405b, batch_405b}};
  std::vector<int> ranks{64, 128, 256, 512};
  int global_batch = 0;  // > 0: overrides both models' defaults
  int seq = default_seq;
  double mfu = default_mfu;
  double tflops = h100_bf16_flops / 1e12;
};

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: fsdp_bench plans --3d [options]   (model and assumptions: bench/plans_3d.cpp)\n"
               "  --model LIST          70b,405b (default: both; 8b also accepted)\n"
               "  --ranks LIST          H100 counts, multiples of 8 (default: 64,128,256,512)\n"
               "  --global-batch N      sequences per step (default: 70b %d, 405b %d)\n"
               "  --seq N               sequence length (default: %d)\n"
               "  --mfu X               kernel efficiency of all compute (default: %.2f)\n"
               "  --tflops X            dense bf16 TFLOPS per GPU (default: %.1f, H100 SXM)\n",
               batch_70b, batch_405b, default_seq, default_mfu, h100_bf16_flops / 1e12);
}

options parse(int argc, char** argv, bool& help) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help = true;
      return o;
    }
    if (i + 1 >= argc) throw fsdp::error(fsdp::errc::invalid_argument, "plans --3d: " + a + " needs a value (see --help)");
    const char* v = argv[++i];
    if (a == "--model") {
      o.models.clear();
      for (const auto& m : split_list(v)) {
        if (m == "8b") o.models.push_back({llama3_8b, batch_70b});
        else if (m == "70b") o.models.push_back({llama3_70b, batch_70b});
        else if (m == "405b") o.models.push_back({llama3_405b, batch_405b});
        else throw fsdp::error(fsdp::errc::invalid_argument, "plans --3d: unknown model '" + m + "' (70b, 405b)");
      }
    } else if (a == "--ranks") {
      o.ranks.clear();
      for (const auto& r : split_list(v)) {
        const int n = parse_int("plans --3d", "--ranks", r.c_str());
        if (n % h100::gpus_per_node != 0)
          throw fsdp::error(fsdp::errc::invalid_argument, "plans --3d: --ranks takes whole 8-GPU nodes, got " + r);
        o.ranks.push_back(n);
      }
    } else if (a == "--global-batch") {
      o.global_batch = parse_int("plans --3d", a, v);
    } else if (a == "--seq") {
      o.seq = parse_int("plans --3d", a, v);
    } else if (a == "--mfu") {
      o.mfu = parse_number("plans --3d", a, v);
    } else if (a == "--tflops") {
      o.tflops = parse_number("plans --3d", a, v);
    } else {
      throw fsdp::error(fsdp::errc::invalid_argument, "plans --3d: unknown option " + a + " (see --help)");
    }
  }
  if (o.global_batch > 0)
    for (auto& m : o.models) m.global_batch = o.global_batch;
  return o;
}

// One configuration and what the model says of it.
struct config {
  int t = 1, p = 1, d = 1;  // TP, PP, DP (FSDP) degrees
  int b = 1, m = 1;         // sequences per micro-batch, micro-batches per step (per DP rank)
  bool recompute = true;    // full activation recomputation
  double fsdp_bytes = 0, grad_bytes = 0, act_bytes = 0, logits_bytes = 0;
  double step_s = 0, bubble_s = 0, tp_s = 0, p2p_s = 0, exposed_dp_s = 0;
  double tokens_per_gpu_s = 0, mfu = 0;
  double memory() const { return fsdp_bytes + grad_bytes + act_bytes + logits_bytes; }
  bool fits() const { return memory() <= h100_hbm_bytes; }
};

// Forward FLOPs per token of each weight matrix group (bench/plans.cpp's count): a block's
// matrices 2 P, attention 4 d seq; the output 2 vocab d.
struct block_shape {
  std::vector<std::size_t> numels;  // attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3
  double matmul_params = 0;
};

block_shape block_of(const llama_shape& m, int t) {
  const std::size_t d = static_cast<std::size_t>(m.dim), f = static_cast<std::size_t>(m.ffn);
  const std::size_t kv = d / static_cast<std::size_t>(m.heads) * static_cast<std::size_t>(m.kv_heads);
  const std::size_t tt = static_cast<std::size_t>(t);
  // Column-parallel wq, wk, wv, w1, w3 and row-parallel wo, w2 all hold 1/t of their matrix;
  // the norms are replicated.
  block_shape b;
  b.numels = {d, d * d / tt, kv * d / tt, kv * d / tt, d * d / tt, d, f * d / tt, d * f / tt, f * d / tt};
  for (std::size_t i = 0; i < b.numels.size(); ++i)
    if (i != 0 && i != 5) b.matmul_params += static_cast<double>(b.numels[i]);
  return b;
}

// Model FLOPs of one token, forward + backward, the whole model (no recomputation).
double model_flops_per_token(const llama_shape& m, int seq) {
  const block_shape b = block_of(m, 1);
  const double fwd = m.layers * (2 * b.matmul_params + 4.0 * m.dim * seq) + 2.0 * static_cast<double>(m.vocab) * m.dim;
  return 3 * fwd;
}

// Prices one configuration; c.t, p, d, b, m and recompute are set by the caller.
void price(const llama_shape& m, const options& o, config& c) {
  const int blocks = (m.layers + c.p - 1) / c.p;
  const double rate = o.tflops * 1e12 * o.mfu;
  const double tokens = static_cast<double>(c.b) * o.seq;  // per micro-batch
  const double h = m.dim;
  const std::size_t vocab_slice = m.vocab / static_cast<std::size_t>(c.t) * static_cast<std::size_t>(m.dim);
  // Units of one pass: p = 1 one micro-batch; p > 1 all m micro-batches (gathered once).
  const double pass_mbs = c.p == 1 ? 1 : c.m;

  step_trace t;
  double stage_params = 0, mb_compute_s = 0;
  auto add = [&](std::string name, std::vector<std::size_t> numels, double fwd_flops, bool recomputed) {
    const double fwd_s = fwd_flops / rate, bwd_s = (recomputed ? 3 : 2) * fwd_flops / rate;
    mb_compute_s += fwd_s + bwd_s;
    unit_profile u{std::move(name), std::move(numels), fwd_s * pass_mbs, bwd_s * pass_mbs};
    stage_params += static_cast<double>(param_numel(u));
    t.units.push_back(std::move(u));
  };
  if (c.p == 1) add("tok_embeddings", {vocab_slice}, 0, false);
  const block_shape bs = block_of(m, c.t);
  const double attn = 4.0 * h * o.seq / c.t;  // per token, heads split over t
  for (int l = 0; l < blocks; ++l)
    add("layers." + std::to_string(l), bs.numels, tokens * (2 * bs.matmul_params + attn), c.recompute);
  add("norm+output", {static_cast<std::size_t>(m.dim), vocab_slice}, tokens * 2 * static_cast<double>(vocab_slice), false);
  use_registration_order(t);
  t.world_size = c.d;
  t.shard_size = c.d;
  t.reshard_after_forward = c.p == 1;
  t.param_elem = 2;  // bf16
  t.reduce_elem = 4;
  t.master_elem = 4;
  t.optimizer_states = 2;
  t.optimizer_s = stage_params / c.d * adamw_bytes_per_element / h100_hbm_bytes_per_s;

  const cost_model dp = h100_strided(c.d, c.t);
  const sim_result r = simulate(t, dp, per_unit_prefetch(t, 1, 1));

  // TP: 4 all-reduces per block (6 with the recomputed forward) of b s h bf16 on NVLink.
  if (c.t > 1) {
    const double bytes = tokens * h * 2 * 2.0 * (c.t - 1) / c.t;  // a ring all-reduce's bytes sent
    const int per_block = c.recompute ? 6 : 4;
    c.tp_s = c.m * blocks * per_block * h100_nvlink(c.t).all_reduce.seconds(static_cast<std::uint64_t>(bytes));
  } else {
    c.tp_s = 0;
  }
  const double tp_mb_s = c.tp_s / c.m;
  if (c.p == 1) {
    c.step_s = c.m * (r.step_s - r.optimizer_s) + r.optimizer_s + c.tp_s;
    c.exposed_dp_s = c.m * r.exposed_comm_s;
    c.bubble_s = c.p2p_s = 0;
  } else {
    c.bubble_s = (c.p - 1) * (mb_compute_s + tp_mb_s);
    // Point-to-point: one NIC, one network hop (h100::ring_latency(1, 1)).
    const double send_s = h100::ring_latency(1, 1) + tokens * h * 2 / c.t / h100::ib_nic_busbw;
    c.p2p_s = 2.0 * (c.m + c.p - 1) * send_s;
    c.step_s = r.step_s + c.tp_s + c.bubble_s + c.p2p_s;
    c.exposed_dp_s = r.exposed_comm_s;
  }

  c.fsdp_bytes = static_cast<double>(r.peak_bytes);
  c.grad_bytes = c.p == 1 ? 0 : stage_params * 2;
  const double block_live = tokens * h * act_bytes_per_sh / c.t;
  const double per_mb = c.recompute ? blocks * tokens * h * 2 / c.t + block_live : blocks * block_live;
  c.act_bytes = (c.p == 1 ? 1 : std::min(c.p, c.m)) * per_mb;
  c.logits_bytes = tokens * static_cast<double>(m.vocab) / c.t * logit_bytes;

  const double ranks = static_cast<double>(c.t) * c.p * c.d;
  const double global_tokens = static_cast<double>(c.d) * c.m * c.b * o.seq;
  c.tokens_per_gpu_s = global_tokens / (c.step_s * ranks);
  c.mfu = global_tokens * model_flops_per_token(m, o.seq) / (c.step_s * ranks * o.tflops * 1e12);
}

// The fastest fitting (b, AC) for one (t, p, d); where none fits, the least memory.
config best_variant(const llama_shape& m, const options& o, int global_batch, int t, int p, int d) {
  const int local = global_batch / d;
  config best;
  bool have = false;
  for (int b = 1; b <= local; b *= 2) {
    if (local % b != 0) continue;
    for (bool rc : {true, false}) {
      config c;
      c.t = t;
      c.p = p;
      c.d = d;
      c.b = b;
      c.m = local / b;
      c.recompute = rc;
      price(m, o, c);
      const bool better = !have                               ? true
                          : c.fits() != best.fits()           ? c.fits()
                          : c.fits()                          ? c.step_s < best.step_s
                                                              : c.memory() < best.memory();
      if (better) {
        best = c;
        have = true;
      }
    }
  }
  return best;
}

void print_header() {
  std::printf("    %3s %3s %4s %9s %4s %8s %4s %9s %9s %7s %6s %6s %6s\n", "TP", "PP", "DP", "mb x seq", "AC",
              "mem GB", "fits", "step s", "tok/s/GPU", "MFU", "TP s", "bubble", "DP exp");
}

void print_row(const config& c, bool best) {
  char mb[32];
  std::snprintf(mb, sizeof mb, "%d x %d", c.m, c.b);
  std::printf("  %s %3d %3d %4d %9s %4s %8.1f %4s %9.2f %9.0f %6.1f%% %6.2f %6.2f %6.2f\n", best ? "*" : " ", c.t, c.p,
              c.d, mb, c.recompute ? "full" : "none", c.memory() / 1e9, c.fits() ? "yes" : "no", c.step_s,
              c.tokens_per_gpu_s, 100 * c.mfu, c.tp_s, c.bubble_s, c.exposed_dp_s);
}

struct published {
  const char* model;
  int ranks, t, p, d;
  const char* source;
};
// Llama 3 paper (arXiv 2407.21783) Table 4: 405B on 8,192 H100s TP 8 CP 1 PP 16 DP 64 and on
// 16,384 TP 8 PP 16 DP 128 (sequence 8192, 16M tokens per batch): outside 64-512, set beside
// the 512-GPU rows with the same TP and PP. torchtitan: benchmarks/llama3_h100_202412_torchtitan.md
// (Dec 2024, H100 96 GB at 500 W, Float8, torch.compile, full AC) Table 4 (70B, 256 GPUs,
// FSDP 32 TP 8) and Table 5 (405B, 512 GPUs, FSDP 8 TP 8 PP 8); the recipes
// torchtitan/models/llama3/train_configs/llama3_70b.toml (TP 8, FSDP the rest, local batch 8) and
// llama3_405b.toml ("a preset for 128 H100 GPUs": TP 8, PP 1, FSDP 16, full AC).
constexpr published published_configs[] = {
    {"llama3-70b", 256, 8, 1, 32, "torchtitan benchmark (Table 4): FSDP 32, TP 8, 829-876 tok/s/GPU, Float8"},
    {"llama3-70b", 64, 8, 1, 8, "torchtitan llama3_70b.toml: TP 8, FSDP the rest, full AC"},
    {"llama3-405b", 128, 8, 1, 16, "torchtitan llama3_405b.toml (128 H100 preset): TP 8, PP 1, FSDP 16, full AC"},
    {"llama3-405b", 512, 8, 8, 8, "torchtitan benchmark (Table 5): FSDP 8, TP 8, PP 8, 100-128 tok/s/GPU, Float8"},
    {"llama3-405b", 512, 8, 16, 4, "Llama 3 paper (Table 4): TP 8, PP 16 (DP 64-128 on 8K-16K GPUs; here DP 4)"},
};

void run_model(const model_entry& e, const options& o) {
  const llama_shape& m = e.shape;
  std::printf("\n%s: global batch %d x %d tokens (%.1fM), bf16 params, f32 master, grads and AdamW; compute at %.0f "
              "TFLOPS x %.2f\n",
              m.name, e.global_batch, o.seq, e.global_batch * static_cast<double>(o.seq) / 1e6, o.tflops, o.mfu);
  std::vector<std::pair<int, config>> bests;  // per rank count
  for (int ranks : o.ranks) {
    std::printf("  %d H100s (%d nodes)\n", ranks, ranks / h100::gpus_per_node);
    print_header();
    std::vector<config> rows;
    for (int t : {1, 2, 4, 8})
      for (int p : {1, 2, 4, 8, 16}) {
        if (ranks % (t * p) != 0 || p > m.layers) continue;
        const int d = ranks / (t * p);
        if (e.global_batch % d != 0) continue;  // whole sequences per DP rank
        rows.push_back(best_variant(m, o, e.global_batch, t, p, d));
      }
    int best = -1;
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (rows[i].fits() && (best < 0 || rows[i].step_s < rows[static_cast<std::size_t>(best)].step_s))
        best = static_cast<int>(i);
    for (std::size_t i = 0; i < rows.size(); ++i) print_row(rows[i], static_cast<int>(i) == best);
    if (best < 0) {
      std::printf("    best: none fits 80 GB\n");
    } else {
      const config& b = rows[static_cast<std::size_t>(best)];
      std::printf("    best: TP %d PP %d DP %d, %d x %d, AC %s: %.1f GB, %.0f tok/s/GPU, MFU %.1f%%\n", b.t, b.p, b.d, b.m,
                  b.b, b.recompute ? "full" : "none", b.memory() / 1e9, b.tokens_per_gpu_s, 100 * b.mfu);
      bests.push_back({ranks, b});
    }
  }
  std::printf("  published configurations beside this model's:\n");
  for (const auto& pc : published_configs) {
    if (std::strcmp(pc.model, m.name) != 0) continue;
    if (std::find(o.ranks.begin(), o.ranks.end(), pc.ranks) == o.ranks.end()) continue;
    if (e.global_batch % pc.d != 0) continue;
    const config c = best_variant(m, o, e.global_batch, pc.t, pc.p, pc.d);
    std::printf("    %s\n      at %d: TP %d PP %d DP %d here: %.1f GB%s, %.0f tok/s/GPU", pc.source, pc.ranks, pc.t, pc.p,
                pc.d, c.memory() / 1e9, c.fits() ? "" : " (over 80 GB)", c.tokens_per_gpu_s);
    for (const auto& [r, b] : bests)
      if (r == pc.ranks)
        std::printf("; best TP %d PP %d DP %d: %.0f tok/s/GPU (%+.0f%%)", b.t, b.p, b.d, b.tokens_per_gpu_s,
                    100 * (b.tokens_per_gpu_s / c.tokens_per_gpu_s - 1));
    std::printf("\n");
  }
}

}  // namespace

int run_plans_3d(int argc, char** argv) {
  try {
    bool help = false;
    const options o = parse(argc, argv, help);
    if (help) {
      usage(stdout);
      return 0;
    }
    std::printf("fsdp plans --3d: TP x PP x FSDP per rank (bench/plans_3d.cpp); FSDP2's per-unit plan simulated on the "
                "DP group (schedule/simulator.hpp), TP all-reduces exposed on NVLink, 1F1B bubble; * = fastest that "
                "fits 80 GB; each row: its fastest fitting micro-batching (m x b sequences) and AC\n");
    for (const auto& e : o.models) run_model(e, o);
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_bench plans --3d: %s\n", e.what());
    return 2;
  }
}
