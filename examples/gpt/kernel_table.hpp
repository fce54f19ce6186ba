#pragma once
// gpt/kernel_table.hpp: the GPU's time summed per kernel and per owner (fsdp, the model, cuBLAS,
// cuDNN, NCCL), for `train_gpt --device cuda --kernel-times` (gpt/cuda/kernel_times.hpp records
// the times through CUPTI). It answers the GPU issues' two questions from any run: where a step's
// GPU time goes, and what share of it is fsdp's own kernels. Plain C++: the host tests check the
// grouping and the table.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gpt {

//! Whose work a kernel is, from its demangled name.
enum class kernel_owner { fsdp, model, cublas, cudnn, nccl, other };

inline const char* to_string(kernel_owner o) {
  switch (o) {
    case kernel_owner::fsdp: return "fsdp";
    case kernel_owner::model: return "model";
    case kernel_owner::cublas: return "cuBLAS";
    case kernel_owner::cudnn: return "cuDNN";
    case kernel_owner::nccl: return "NCCL";
    case kernel_owner::other: return "other";
  }
  return "other";
}

//! By the kernel's own name (the demangled name without its "void "): the model's (gpt::...,
//! whatever its template arguments, fsdp::bf16 among them), fsdp's own (fsdp::...), NCCL's
//! (nccl...), Thrust's and CUB's instantiated with one of fsdp's functors (the casts, the
//! accumulation, the optimizers, the norm), cuDNN's (cudnn in its generated kernels' names),
//! cuBLAS's GEMMs (gemm, cutlass, xmma, nvjet: cuBLAS 12.8+'s Hopper kernels); else other (memsets and copies, CUB passes with no fsdp
//! type in their name).
inline kernel_owner owner_of(std::string_view name) {
  if (name.starts_with("void ")) name.remove_prefix(5);
  auto has = [&](std::string_view s) { return name.find(s) != std::string_view::npos; };
  if (name.starts_with("gpt::")) return kernel_owner::model;
  if (name.starts_with("fsdp::")) return kernel_owner::fsdp;
  if (has("nccl") || has("NCCL")) return kernel_owner::nccl;
  if ((name.starts_with("thrust::") || name.starts_with("cub::")) && has("fsdp::")) return kernel_owner::fsdp;
  if (has("cudnn") || has("fmha")) return kernel_owner::cudnn;
  if (has("gemm") || has("Gemm") || has("cutlass") || has("xmma") || has("nvjet") || has("cublas")) return kernel_owner::cublas;
  return kernel_owner::other;
}

//! GPU time per kernel name (demangled) and per owner, over the steps recorded.
class kernel_table {
 public:
  void add(const std::string& name, std::uint64_t ns) {
    entry& e = by_name_[name];
    e.ns += ns;
    ++e.count;
  }
  bool empty() const { return by_name_.empty(); }
  std::uint64_t total_ns() const {
    std::uint64_t t = 0;
    for (const auto& [name, e] : by_name_) t += e.ns;
    return t;
  }
  std::uint64_t owner_ns(kernel_owner o) const {
    std::uint64_t t = 0;
    for (const auto& [name, e] : by_name_)
      if (owner_of(name) == o) t += e.ns;
    return t;
  }
  //! Per step (over `steps`): the GPU time, each owner's share, then the `top` kernels by time
  //! with their calls a step (their names cut to 100 characters), largest first.
  std::string format(int steps, std::size_t top = 25) const {
    const double total = static_cast<double>(total_ns()), per_step = steps > 0 ? 1e-6 / steps : 0;
    auto pct = [&](std::uint64_t ns) { return total > 0 ? 100.0 * static_cast<double>(ns) / total : 0.0; };
    std::string out;
    char line[256];
    std::snprintf(line, sizeof line, "GPU time: %.3f ms a step (this process's kernels, memsets and copies summed: overlapping ones count in full; "
                  "over %d steps)\n",
                  total * per_step, steps);
    out += line;
    for (const kernel_owner o : {kernel_owner::model, kernel_owner::cublas, kernel_owner::cudnn, kernel_owner::fsdp, kernel_owner::nccl,
                                 kernel_owner::other}) {
      const std::uint64_t ns = owner_ns(o);
      std::snprintf(line, sizeof line, "  %-7s %6.2f%%  %9.3f ms a step\n", to_string(o), pct(ns), static_cast<double>(ns) * per_step);
      out += line;
    }
    std::vector<std::pair<std::string, entry>> rows(by_name_.begin(), by_name_.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
    if (rows.size() > top) rows.resize(top);
    for (const auto& [name, e] : rows) {
      std::snprintf(line, sizeof line, "  %6.2f%% %9.3f ms %7.1f calls  %-6s %.100s\n", pct(e.ns), static_cast<double>(e.ns) * per_step,
                    steps > 0 ? static_cast<double>(e.count) / steps : 0.0, to_string(owner_of(name)), name.c_str());
      out += line;
    }
    return out;
  }

 private:
  struct entry {
    std::uint64_t ns = 0;
    std::size_t count = 0;
  };
  std::map<std::string, entry> by_name_;
};

}  // namespace gpt
