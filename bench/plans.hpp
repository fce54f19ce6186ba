#pragma once
// What bench/plans.cpp (`fsdp_bench plans`) and bench/plans_3d.cpp (`fsdp_bench plans --3d`)
// share: the Llama 3 shapes and the H100 constants, each with where its number comes from.

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"

namespace fsdp_bench_plans {

// Shapes from the Llama 3 paper (arXiv 2407.21783, Table 3), untied input and output embeddings.
struct llama_shape {
  const char* name;
  int layers, dim, ffn, heads, kv_heads;
  std::size_t vocab;
};
inline constexpr llama_shape llama3_8b{"llama3-8b", 32, 4096, 14336, 32, 8, 128256};
inline constexpr llama_shape llama3_70b{"llama3-70b", 80, 8192, 28672, 64, 8, 128256};
inline constexpr llama_shape llama3_405b{"llama3-405b", 126, 16384, 53248, 128, 8, 128256};

// H100 SXM dense BF16 tensor throughput: 1979 TFLOPS "with sparsity" in NVIDIA's H100
// datasheet, half of it dense.
inline constexpr double h100_bf16_flops = 989.4e12;
// Model FLOPs utilization: Llama 3 405B trained at 38-43 % BF16 MFU on 8K-16K H100s (Llama 3
// paper, Table 4: 380-430 TFLOPs per GPU).
inline constexpr double default_mfu = 0.40;
// H100 SXM HBM3: 80 GB at 3.35 TB/s (NVIDIA H100 datasheet).
inline constexpr double h100_hbm_bytes_per_s = 3.35e12;
inline constexpr double h100_hbm_bytes = 80e9;
// AdamW on f32 master weights is memory-bound: it reads parameter, gradient and two moments
// and writes parameter and moments, 7 x 4 bytes per element of the local shard.
inline constexpr double adamw_bytes_per_element = 28;

// The commands' option parsing: "a,b,c" as its parts; a positive number, or a positive whole
// number (at most 1e9), else fsdp::error naming the command (`cmd`: "plans", "plans --3d") and flag.
inline std::vector<std::string> split_list(const char* s) {
  std::vector<std::string> out(1);
  for (const char* p = s; *p; ++p)
    if (*p == ',') out.emplace_back();
    else out.back() += *p;
  return out;
}
inline double parse_number(const char* cmd, const std::string& flag, const char* s) {
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || *end != '\0' || !(v > 0))
    throw fsdp::error(fsdp::errc::invalid_argument, std::string(cmd) + ": " + flag + " needs a positive number, got '" + s + "'");
  return v;
}
inline int parse_int(const char* cmd, const std::string& flag, const char* s) {
  const double v = parse_number(cmd, flag, s);
  if (v != std::floor(v) || v > 1e9)
    throw fsdp::error(fsdp::errc::invalid_argument, std::string(cmd) + ": " + flag + " needs a whole number, got '" + s + "'");
  return static_cast<int>(v);
}

}  // namespace fsdp_bench_plans

// `fsdp_bench plans --3d [options]` (bench/plans_3d.cpp); argv[0] is "--3d".
int run_plans_3d(int argc, char** argv);
