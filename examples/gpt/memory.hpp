#pragma once
// gpt/memory.hpp: what a run of the GPT model needs in host memory, computed from its shape
// before anything is allocated, and what the machine has, so that train_gpt can refuse a model
// too big for the machine up front (with its size) instead of dying of std::bad_alloc, or of
// the kernel's OOM killer, partway into building it.
//
//   const gpt::memory_need need = gpt::estimate_memory(run, {.ranks = 4, .shard_size = 4});
//   const gpt::memory_available have = gpt::available_memory();
//   if (need.total > have.bytes) ...  // need.params, need.per_rank, have.source
//
// The estimate is rough: within about 15% of the peak resident size of the runs tried (dims
// 256 to 1024, fp32 and bf16, full and grad_op sharding); the corpus, the thread stacks and
// the allocator's slack are not counted.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

#include <sys/resource.h>
#include <unistd.h>

#include "gpt/train.hpp"

namespace gpt {

//! Elements of the model's parameters (wte counted once): what model<T>::numel() returns,
//! computed from the shape alone, in double (no overflow at any shape the flags accept).
inline double parameter_count(const config& c) {
  const double C = c.dim, V = c.vocab, T = c.seq, L = c.layers;
  const double embedding = V * C + T * C + 2 * C;  // wte, wpe, lnf_w, lnf_b
  const double block = 12 * C * C + 13 * C;        // ln1 2C, qkv 3C*C+3C, proj C*C+C, ln2 2C, fc 4C*C+4C, out 4C*C+C
  return embedding + L * block;
}

//! How the run is laid out over ranks.
struct memory_layout {
  int ranks = 1;                     //!< ranks in the run (the global batch is split over them)
  int ranks_here = 1;                //!< of which on this machine (threads: all of them)
  int shard_size = 1;                //!< ranks sharing one copy of the parameters
  bool reshard_after_forward = true; //!< false: every unit stays gathered from forward to backward
  int prefetch = 1;                  //!< units gathered ahead
  bool bf16 = false;                 //!< bf16 parameters (fp32 master, gradients and moments)
};

//! Bytes, as doubles (they are estimates, and can exceed 2^64 only in absurd shapes).
struct memory_need {
  double params = 0;       //!< parameter count
  double state = 0;        //!< per rank: sharded fp32 master, gradient and two AdamW moments
  double model_copy = 0;   //!< per rank: the model's own full copy, until finalize releases it
  double gathered = 0;     //!< per rank: gathered units and unsharded gradients in a step
  double activations = 0;  //!< per rank: what forward keeps for backward, and backward's scratch
  double per_rank = 0;     //!< the sum of the above
  double total = 0;        //!< per_rank * ranks_here: what this machine must hold
};

//! What a run of `o` over `l` needs (see memory_need).
inline memory_need estimate_memory(const run_options& o, const memory_layout& l) {
  const config& c = o.model;
  const double C = c.dim, V = c.vocab, T = c.seq, L = c.layers, H = c.heads;
  const double pb = l.bf16 ? 2 : 4;  // bytes per parameter element
  const double S = std::max(1, l.shard_size);
  const double B = (o.batch + l.ranks - 1) / std::max(1, l.ranks);  // this rank's sequences
  memory_need n;
  n.params = parameter_count(c);
  n.state = n.params / S * (4 + 4 + 8);
  // Every rank builds the whole model (each fsdp::buffer holds its initial values) before
  // finalize shards it and frees the copies.
  n.model_copy = n.params * pb;
  const double unit = std::max(V * C + T * C + 2 * C, L > 0 ? 12 * C * C + 13 * C : 0.0);  // the largest unit
  const double gathered_units = l.reshard_after_forward ? std::min(n.params, (2 + l.prefetch) * unit) : n.params;
  n.gathered = gathered_units * pb + unit * (pb + 4);  // + one unit's unsharded gradient and its fp32 reduction
  // Floats per token kept by forward: per block x, ln1, qkv (3C), atty, x_mid, ln2, fc and its
  // gelu (4C each), the attention probabilities (H*T) and 4 norms' statistics; then x_final,
  // lnf, dx and the probabilities over the vocabulary (their gradient, in place). Backward's
  // scratch per token: dgelu (4C), dln, datty, dqkv (3C), dln1. The kernels' transposed or
  // float copies of the widest weight (4C x C): three of them.
  const double per_token = L * (16 * C + H * T + 4) + 3 * C + V + 2 + 10 * C;
  n.activations = 4 * (B * T * per_token + 3 * 4 * C * C);
  // The model's copy is freed before the first step, but the allocator keeps much of it (the
  // peak resident size of a run is close to the sum).
  n.per_rank = n.state + n.model_copy + n.gathered + n.activations;
  n.total = n.per_rank * std::max(1, l.ranks_here);
  return n;
}

//! The memory this process can count on, and where the figure came from.
struct memory_available {
  double bytes = 0;     //!< 0 when unknown
  std::string source;   //!< "MemAvailable", "physical memory", or "cgroup memory.max"
};

//! /proc/meminfo's MemAvailable (else the physical memory), lowered to the cgroup's limit
//! (memory.max less memory.current) where one is set.
inline memory_available available_memory() {
  memory_available out;
  {
    std::ifstream in("/proc/meminfo");
    std::string key;
    double kib = 0;
    std::string unit;
    while (in >> key >> kib >> unit)
      if (key == "MemAvailable:") {
        out = {kib * 1024, "MemAvailable"};
        break;
      }
  }
  if (out.bytes <= 0) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) out = {static_cast<double>(pages) * static_cast<double>(page), "physical memory"};
  }
  double limit = 0, current = 0;
  if ((std::ifstream("/sys/fs/cgroup/memory.max") >> limit) && limit > 0) {  // "max" fails to parse: no limit
    std::ifstream("/sys/fs/cgroup/memory.current") >> current;
    const double left = std::max(0.0, limit - current);
    if (out.bytes <= 0 || left < out.bytes) out = {left, "cgroup memory.max"};
  }
  return out;
}

//! The address space a run needs under a limit (ulimit -v, RLIMIT_AS), and the limit; both 0
//! when there is none. OpenBLAS 0.3.21 hangs (in blas_memory_alloc) when it cannot map its
//! buffers, so a --matmul blas run is checked before it starts. What it counts: what the
//! process maps now, the estimate, and for each of `threads` its stack and a malloc arena
//! (glibc reserves 64 MiB each, at most 8 per core), plus 64 MiB of OpenBLAS buffers per thread
//! that calls it (`blas_callers`). Where the 64 MiB comes from: 4 thread ranks mapped 262 MiB
//! more with --matmul blas than with loops (1.37 against 1.11 GiB, 2026-11-28), and such a run
//! hung under 1.2 GiB and ran under 1.5 GiB.
struct address_space {
  double limit = 0;
  double need = 0;
};
inline address_space address_space_needed(double estimate, int threads, int blas_callers) {
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) != 0 || as.rlim_cur == RLIM_INFINITY) return {};
  double mapped = 0;
  std::ifstream status("/proc/self/status");
  for (std::string key; status >> key;) {
    if (key == "VmSize:") {
      status >> mapped;
      mapped *= 1024;
      break;
    }
    status.ignore(1 << 12, '\n');
  }
  rlimit stack{};
  const double stack_bytes = getrlimit(RLIMIT_STACK, &stack) == 0 && stack.rlim_cur != RLIM_INFINITY ? double(stack.rlim_cur) : 8.0 * (1 << 20);
  const double arenas = std::min<double>(threads, 8.0 * std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  const double mib = 1 << 20;
  return {double(as.rlim_cur), mapped + estimate + threads * stack_bytes + arenas * 64 * mib + blas_callers * 64 * mib};
}

//! "1.23 GiB" (or MiB, TiB).
inline std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int k = 0;
  while (bytes >= 1024 && k < 6) bytes /= 1024, ++k;
  char s[32];
  std::snprintf(s, sizeof s, k == 0 ? "%.0f %s" : "%.2f %s", bytes, units[k]);
  return s;
}

}  // namespace gpt
