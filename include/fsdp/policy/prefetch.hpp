#pragma once
//! \file Prefetch: how early the next all-gathers are issued, which bounds in-flight memory.
//! A value, chosen at run time.
//!
//!   fsdp::prefetch{}                                 keep 1 bucket ahead in each direction
//!   fsdp::no_prefetch()                              gather each bucket when it is needed
//!   fsdp::prefetch{.forward = 2, .forward_units = {...}}   an explicit unit order instead of
//!                                                    the order recorded in the first step
//!
//! The runtime turns the depths into a schedule::plan (schedule::prefetch_plan) once the unit
//! order is known and replays it; a plan made elsewhere is given as shard_group's options.plan.

#include <string>
#include <vector>

namespace fsdp {

//! Prefetching of a shard_group. Its contract:
//!   1. forward and backward (>= 0) are how many buckets past the one in use may be gathered
//!      ahead in that direction: the all-gather of the bucket at position p is issued at the
//!      pre-hook of position max(0, p - depth); 0 gathers on demand;
//!   2. forward_units and backward_units, when not empty, give the unit order to prefetch in
//!      from the first step (else the order the first step recorded is used); an empty
//!      backward_units with a forward_units means the reverse of forward_units.
struct prefetch {
  int forward = 1;
  int backward = 1;
  std::vector<int> forward_units{};
  std::vector<int> backward_units{};
  friend bool operator==(const prefetch&, const prefetch&) = default;
};

inline prefetch no_prefetch() { return {.forward = 0, .backward = 0}; }

inline std::string to_string(const prefetch& p) {
  return "prefetch{.forward = " + std::to_string(p.forward) + ", .backward = " + std::to_string(p.backward) +
         (p.forward_units.empty() && p.backward_units.empty() ? "}" : ", explicit order}");
}

}  // namespace fsdp
