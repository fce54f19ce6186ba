#pragma once
//! \file auto_bucket: buckets and issue points from a recorded trace and a cost model
//! (SimpleFSDP's auto-bucketing), under a per-rank memory limit. It makes a schedule::plan,
//! which a shard_group replays when given as its options.plan: profile a few steps with any
//! group, then build the group that trains with
//!
//!   const fsdp::schedule::plan p = fsdp::auto_bucket{.memory_limit = std::size_t{40} << 30}
//!       .plan_for(profiling_group.step_trace(), fsdp::schedule::calibrate(comm, queue));
//!   fsdp::shard_group<fsdp::buffer<float>> group{comm, {}, {.plan = p}};
//!
//! plan_for is schedule::greedy_plan (or schedule::best_plan with .search = true). Every rank
//! must plan from the same trace and cost model, so that every rank replays the same plan:
//! step_trace() averages its timings over the ranks, and calibrate() returns the same model
//! everywhere. A plan written by hand (or saved from an earlier run) is given the same way.

#include <cstddef>
#include <limits>
#include <string>

#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/planner.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp {

struct auto_bucket {
  std::size_t memory_limit = 0;  //!< peak bytes per rank the plan must stay under; 0: no limit
  bool search = false;           //!< schedule::best_plan's search instead of the greedy

  //! The plan for a trace: buckets and issue points under memory_limit, named
  //! "auto_bucket{.memory_limit = ...}", with the trace's unit bytes (so a group of other
  //! units or dtypes refuses it). Throws fsdp::error(errc::invalid_argument) on an invalid
  //! trace or cost model, or when no plan fits.
  schedule::plan plan_for(const schedule::checked_trace& t, const schedule::cost_model& c) const {
    const std::size_t limit = memory_limit == 0 ? std::numeric_limits<std::size_t>::max() : memory_limit;
    schedule::plan p = search ? schedule::best_plan(t, c, limit) : schedule::greedy_plan(t, c, limit);
    p.name = to_string(*this);
    p.unit_bytes.clear();
    for (const auto& u : t->units) p.unit_bytes.push_back(schedule::param_numel(u) * t->param_elem);
    return p;
  }

  friend bool operator==(const auto_bucket&, const auto_bucket&) = default;
  //! "auto_bucket{.memory_limit = 42949672960}", with ", .search = true" when set.
  friend std::string to_string(const auto_bucket& b) {
    return "auto_bucket{.memory_limit = " + std::to_string(b.memory_limit) + (b.search ? ", .search = true" : "") + "}";
  }
};

}  // namespace fsdp
