// `fsdp_bench plans`: paper planning. For Llama-3-like models on 8 to 512 H100s it builds the
// step trace from the model's shapes and a FLOP count, and prints, for FSDP2's per-unit plan
// (prefetch 1), the greedy plan and the searched plan: step time, exposed communication and
// peak memory per rank, and the memory limit the planners were given.
//
//   fsdp_bench plans                                 every model at 8, 64 and 512 ranks
//   fsdp_bench plans --model 70b --ranks 64,512 --shard 8   hybrid: shard groups of 8
//   fsdp_bench plans --help
//   fsdp_bench plans --3d [--help]                    TP x PP x FSDP configurations of Llama 3 70B
//                                                    and 405B on 64-512 H100s (bench/plans_3d.cpp)
//
// What is modelled: the collectives and the memory shard_group allocates (schedule/simulator.hpp)
// with bf16 parameters and f32 reduction, master weights and AdamW moments. Not modelled:
// activations (the limit is a multiple of FSDP2's own peak, not of HBM), tensor or pipeline
// parallelism, and any slowdown of compute by concurrent communication. `--3d` (first argument)
// adds TP, PP and activations on top of this simulator: see bench/plans_3d.cpp.

#include <algorithm>
#include <cstddef>
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
#include "fsdp/schedule/planner.hpp"
#include "fsdp/schedule/simulator.hpp"
#include "fsdp/schedule/trace.hpp"
#include "plans.hpp"

namespace {

using namespace fsdp::schedule;
using namespace fsdp_bench_plans;

struct options {
  std::vector<llama_shape> models{llama3_8b, llama3_70b, llama3_405b};
  std::vector<int> ranks{8, 64, 512};
  int shard = 0;  // 0: full_shard over all ranks
  int seq = 8192;
  int batch = 1;
  double mfu = default_mfu;
  double tflops = h100_bf16_flops / 1e12;
  double limit_ratio = 1.25;
  double limit_gib = 0;  // > 0: an absolute limit instead of the ratio
  int evals = 20000;
};

void usage(std::FILE* out) {
  std::fprintf(out,
               "usage: fsdp_bench plans [options]\n"
               "       fsdp_bench plans --3d [options]   TP x PP x FSDP tables (fsdp_bench plans --3d --help)\n"
               "  --model LIST       8b,70b,405b (default: all)\n"
               "  --ranks LIST       world sizes (default: 8,64,512); 8 or fewer use the NVLink profile\n"
               "  --shard N          shard group size (hybrid_shard); default: all ranks (full_shard)\n"
               "  --seq N --batch N  tokens per rank = seq x batch (default: 8192 x 1)\n"
               "  --mfu X            model FLOPs utilization (default: %.2f, Llama 3's 38-43 %%)\n"
               "  --tflops X         dense bf16 TFLOPS per GPU (default: %.1f, H100 SXM)\n"
               "  --limit-ratio X    memory limit = X times FSDP2's per-unit peak (default: 1.25)\n"
               "  --limit-gib X      an absolute memory limit per rank instead\n"
               "  --evals N          simulations the searched plan may use (default: 20000)\n",
               default_mfu, h100_bf16_flops / 1e12);
}

options parse(int argc, char** argv, bool& help) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help = true;
      return o;
    }
    if (i + 1 >= argc) throw fsdp::error(fsdp::errc::invalid_argument, "plans: " + a + " needs a value (see --help)");
    const char* v = argv[++i];
    if (a == "--model") {
      o.models.clear();
      for (const auto& m : split_list(v)) {
        if (m == "8b") o.models.push_back(llama3_8b);
        else if (m == "70b") o.models.push_back(llama3_70b);
        else if (m == "405b") o.models.push_back(llama3_405b);
        else throw fsdp::error(fsdp::errc::invalid_argument, "plans: unknown model '" + m + "' (8b, 70b, 405b)");
      }
    } else if (a == "--ranks") {
      o.ranks.clear();
      for (const auto& r : split_list(v)) o.ranks.push_back(parse_int("plans", "--ranks", r.c_str()));
    } else if (a == "--shard") {
      o.shard = parse_int("plans", "--shard", v);
    } else if (a == "--seq") {
      o.seq = parse_int("plans", "--seq", v);
    } else if (a == "--batch") {
      o.batch = parse_int("plans", "--batch", v);
    } else if (a == "--mfu") {
      o.mfu = parse_number("plans", "--mfu", v);
    } else if (a == "--tflops") {
      o.tflops = parse_number("plans", "--tflops", v);
    } else if (a == "--limit-ratio") {
      o.limit_ratio = parse_number("plans", "--limit-ratio", v);
    } else if (a == "--limit-gib") {
      o.limit_gib = parse_number("plans", "--limit-gib", v);
    } else if (a == "--evals") {
      o.evals = parse_int("plans", "--evals", v);
    } else {
      throw fsdp::error(fsdp::errc::invalid_argument, "plans: unknown option " + a + " (see --help)");
    }
  }
  return o;
}

// The step of one rank: units = token embedding, one per transformer block, final norm and
// output projection (FSDP2's wrapping in torchtitan). Compute from FLOPs: a matrix multiply of
// P parameters costs 2 P FLOPs per token forward and 4 P backward; attention adds 4 d seq per
// token and layer forward and twice that backward (PaLM's 12 L d seq for both, PaLM paper,
// appendix B); the embedding lookup is taken as free.
struct model_step {
  step_trace trace;
  double params = 0;      // all parameters
  double flops = 0;       // per rank and step
};

model_step llama_step(const llama_shape& m, int world, int shard, const options& o) {
  model_step s;
  step_trace& t = s.trace;
  const std::size_t d = static_cast<std::size_t>(m.dim), f = static_cast<std::size_t>(m.ffn);
  const std::size_t kv = d / static_cast<std::size_t>(m.heads) * static_cast<std::size_t>(m.kv_heads);
  const double tokens = static_cast<double>(o.seq) * o.batch;
  const double rate = o.tflops * 1e12 * o.mfu;
  auto add = [&](std::string name, std::vector<std::size_t> numels, double fwd_flops) {
    unit_profile u{std::move(name), std::move(numels), fwd_flops / rate, 2 * fwd_flops / rate};
    s.params += static_cast<double>(param_numel(u));
    s.flops += 3 * fwd_flops;
    t.units.push_back(std::move(u));
  };
  add("tok_embeddings", {m.vocab * d}, 0);
  for (int l = 0; l < m.layers; ++l) {
    // attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3
    std::vector<std::size_t> block{d, d * d, kv * d, kv * d, d * d, d, f * d, d * f, f * d};
    double matmul = 0;
    for (std::size_t i = 0; i < block.size(); ++i)
      if (i != 0 && i != 5) matmul += static_cast<double>(block[i]);
    add("layers." + std::to_string(l), std::move(block), tokens * (2 * matmul + 4.0 * static_cast<double>(d) * o.seq));
  }
  add("norm+output", {d, m.vocab * d}, tokens * 2 * static_cast<double>(m.vocab * d));
  use_registration_order(t);
  t.world_size = world;
  t.shard_size = shard;
  t.param_elem = 2;  // bf16
  t.reduce_elem = 4;
  t.master_elem = 4;
  t.optimizer_states = 2;
  t.optimizer_s = s.params / shard * adamw_bytes_per_element / h100_hbm_bytes_per_s;
  return s;
}

// The buckets as unit ranges, runs of equal-sized buckets folded: "0-1 | 2 | 3-32 (15 x 2) | 33".
std::string compact_buckets(const plan& p) {
  std::vector<std::pair<int, int>> ranges;  // first, last unit
  for (std::size_t u = 0; u < p.bucket_of_unit.size(); ++u)
    if (u == 0 || p.bucket_of_unit[u] != p.bucket_of_unit[u - 1]) ranges.push_back({static_cast<int>(u), static_cast<int>(u)});
    else ranges.back().second = static_cast<int>(u);
  std::string out;
  for (std::size_t i = 0; i < ranges.size();) {
    const int size = ranges[i].second - ranges[i].first + 1;
    std::size_t j = i;
    while (j + 1 < ranges.size() && ranges[j + 1].second - ranges[j + 1].first + 1 == size) ++j;
    const auto [first, last] = std::pair{ranges[i].first, ranges[j].second};
    out += (out.empty() ? "" : " | ") + std::to_string(first) + (last > first ? "-" + std::to_string(last) : "");
    if (j > i) out += " (" + std::to_string(j - i + 1) + " x " + std::to_string(size) + ")";
    i = j + 1;
  }
  return out;
}

double gib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

void print_row(const plan& p, const sim_result& r) {
  std::printf("  %-9s %8d %9.3f %10.3f %8.1f%% %11.3f %9.1f%s\n", p.name.c_str(), p.num_buckets(), r.step_s,
              r.exposed_comm_s, 100.0 * r.exposed_comm_s / r.step_s, r.comm_busy_s, gib(r.peak_bytes),
              static_cast<double>(r.peak_bytes) > h100_hbm_bytes ? "  over 80 GB HBM" : "");
}

void run_one(const llama_shape& m, int world, const options& o) {
  const int shard = o.shard > 0 ? std::min(o.shard, world) : world;
  if (world % shard != 0)
    throw fsdp::error(fsdp::errc::invalid_argument, "plans: --shard " + std::to_string(shard) + " does not divide " +
                                                        std::to_string(world) + " ranks");
  const model_step s = llama_step(m, world, shard, o);
  const bool one_node = world <= h100::gpus_per_node;
  const cost_model c = one_node ? h100_nvlink(world) : h100_infiniband(shard, world / shard);
  const step_trace& t = s.trace;

  const plan fsdp2 = per_unit_prefetch(t, 1, 1);
  const sim_result base = simulate(t, c, fsdp2);
  const std::size_t limit = o.limit_gib > 0
                                ? static_cast<std::size_t>(o.limit_gib * 1024 * 1024 * 1024)
                                : static_cast<std::size_t>(static_cast<double>(base.peak_bytes) * o.limit_ratio);

  std::printf("\n%s (%.2fB params, %d units), %d ranks, %s, %s\n", m.name, s.params / 1e9, t.num_units(), world,
              shard == world ? "full_shard" : ("hybrid_shard{.shard_size = " + std::to_string(shard) + "}").c_str(),
              one_node ? "H100 NVLink" : "H100 InfiniBand NDR 8 x 400 Gb/s per node");
  std::printf("  bf16 params, f32 reduce and master, AdamW; %d tokens/rank (seq %d x batch %d); compute %.3f s/step "
              "(%.3g FLOPs at %.0f TFLOPS x MFU %.2f)\n",
              o.seq * o.batch, o.seq, o.batch, base.compute_s, s.flops, o.tflops, o.mfu);
  std::printf("  all-gather alpha %.0f us, busbw %.0f GB/s; memory limit %.1f GiB/rank (%s; activations not modelled)\n",
              c.all_gather.alpha_s * 1e6, c.all_gather.beta_bytes_per_s / 1e9, gib(limit),
              o.limit_gib > 0 ? "--limit-gib" : (std::to_string(o.limit_ratio).substr(0, 4) + " x per-unit peak").c_str());
  std::printf("  %-9s %8s %9s %10s %9s %11s %9s\n", "plan", "buckets", "step s", "exposed s", "exposed", "comm busy s",
              "peak GiB");
  print_row(fsdp2, base);
  try {
    const plan g = greedy_plan(t, c, limit);
    print_row(g, simulate(t, c, g));
    const plan b = best_plan(t, c, limit, {.max_evaluations = o.evals});
    print_row(b, simulate(t, c, b));
    std::printf("  best buckets: %s\n", compact_buckets(b).c_str());
  } catch (const fsdp::error& e) {
    std::printf("  %s\n", e.what());
  }
}

}  // namespace

// Declared in bench/main.cpp; argv[0] is "plans".
int run_plans_command(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--3d") == 0) return run_plans_3d(argc - 1, argv + 1);
  try {
    bool help = false;
    const options o = parse(argc, argv, help);
    if (help) {
      usage(stdout);
      return 0;
    }
    std::printf("fsdp plans: simulated steps per rank (schedule/simulator.hpp); per_unit = FSDP2 (one bucket per "
                "unit, prefetch 1), greedy = SimpleFSDP-style auto-bucketing, best = searched\n");
    for (const auto& m : o.models)
      for (int w : o.ranks) run_one(m, w, o);
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_bench plans: %s\n", e.what());
    return 2;
  }
}
