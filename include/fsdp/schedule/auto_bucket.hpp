#pragma once
//! \file Two BucketPolicies that plan, both replayed by shard_group through plan(request)
//! (planning_bucket_policy, plan.hpp): its buckets, where each all-gather is issued and how
//! long each reduction may stay in flight.
//!
//! auto_bucket buckets from a recorded trace and a cost model (SimpleFSDP's auto-bucketing)
//! under a per-rank memory limit. It carries both by value: profile a few steps with any
//! policy, then build the group that trains with
//!
//!   fsdp::auto_bucket a{.memory_limit = std::size_t{40} << 30,
//!                       .trace = profiling_group.step_trace(),
//!                       .cost = fsdp::schedule::calibrate(comm, queue)};
//!   fsdp::shard_group<fsdp::buffer<float>, fsdp::full_shard, fsdp::auto_bucket> group{
//!       comm, {}, {.bucket = a}};
//!
//! Until both trace and cost are set it has no plan and assigns one bucket per unit, as
//! per_unit does (and the group follows its Prefetch policy). With them, plan() is
//! schedule::greedy_plan (or schedule::best_plan with .search = true) of the trace. Every rank
//! must hold the same trace and cost model, so that every rank replays the same plan: agree on
//! the timings first (e.g. all-reduce them); calibrate() already returns the same model
//! everywhere.
//!
//! planned replays a plan given by hand (or saved from an earlier run):
//!
//!   fsdp::planned manual{fsdp::schedule::from_policies(trace, {0, 0, 1, 1}, 2, 1)};

#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/policy/bucket.hpp"
#include "fsdp/schedule/cost_model.hpp"
#include "fsdp/schedule/plan.hpp"
#include "fsdp/schedule/planner.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp {

namespace detail {
// "auto_bucket{.memory_limit = N}" with ", .search = true" when set: the values that choose a
// plan, also the name of the plans it makes.
inline std::string auto_bucket_values(std::size_t memory_limit, bool search, const std::string& more = {}) {
  return "auto_bucket{.memory_limit = " + std::to_string(memory_limit) + (search ? ", .search = true" : "") + more + "}";
}
}  // namespace detail

struct auto_bucket {
  std::size_t memory_limit = 0;                  //!< peak bytes per rank the plan must stay under; 0: no limit
  bool search = false;                           //!< schedule::best_plan's search instead of the greedy
  std::optional<schedule::step_trace> trace{};   //!< from shard_group::step_trace() of profiling steps
  std::optional<schedule::cost_model> cost{};    //!< calibrate(), a link model, or a named profile

  //! BucketPolicy::assign: per unit, its bucket. One bucket per unit until trace and cost are
  //! set, else plan(r)->bucket_of_unit. Throws what plan() throws.
  std::vector<int> assign(const bucket_request& r) const {
    if (auto p = plan(r)) return std::move(p->bucket_of_unit);
    return per_unit{}.assign(r);
  }

  //! The plan the group replays: nullopt until trace and cost are set, else
  //! plan_for(*trace, *cost). Throws fsdp::error(errc::invalid_argument) when the trace does
  //! not describe the request's units (another unit count, or a unit whose parameter bytes,
  //! param_numels x param_elem, differ), and what plan_for() throws.
  std::optional<schedule::plan> plan(const bucket_request& r) const {
    if (!trace || !cost) return std::nullopt;
    const schedule::step_trace& t = *trace;
    if (t.units.size() != r.unit_bytes.size())
      throw error(errc::invalid_argument, "auto_bucket: the trace has " + std::to_string(t.units.size()) +
                                              " units, the request " + std::to_string(r.unit_bytes.size()));
    for (std::size_t u = 0; u < t.units.size(); ++u) {
      const std::size_t bytes = schedule::param_numel(t.units[u]) * t.param_elem;
      if (bytes != r.unit_bytes[u])
        throw error(errc::invalid_argument, "auto_bucket: unit " + std::to_string(u) + " has " +
                                                std::to_string(r.unit_bytes[u]) + " parameter bytes, the trace " +
                                                std::to_string(bytes) + " (a trace of another model or dtype?)");
    }
    return plan_for(t, *cost);
  }

  //! The plan for a trace: buckets and issue points, under memory_limit, named
  //! "auto_bucket{.memory_limit = ...}". Throws fsdp::error(errc::invalid_argument) on an
  //! invalid trace or cost model, or when no plan fits.
  schedule::plan plan_for(const schedule::step_trace& t, const schedule::cost_model& c) const {
    const std::size_t limit = memory_limit == 0 ? std::numeric_limits<std::size_t>::max() : memory_limit;
    schedule::plan p = search ? schedule::best_plan(t, c, limit) : schedule::greedy_plan(t, c, limit);
    p.name = detail::auto_bucket_values(memory_limit, search);
    return p;
  }

  friend bool operator==(const auto_bucket&, const auto_bucket&) = default;
};

static_assert(bucket_policy<auto_bucket>);
static_assert(planning_bucket_policy<auto_bucket>);

//! "auto_bucket{.memory_limit = 42949672960}", with ", .search = true", ", .trace = {N units}"
//! and ", .cost = cost_model{...}" when set.
inline std::string to_string(const auto_bucket& b) {
  std::string more;
  if (b.trace) more += ", .trace = {" + std::to_string(b.trace->units.size()) + " units}";
  if (b.cost) more += ", .cost = " + schedule::to_string(*b.cost);
  return detail::auto_bucket_values(b.memory_limit, b.search, more);
}

//! A plan given by hand, replayed as it is: assign() is its bucket_of_unit, plan() the plan.
//! Both throw fsdp::error(errc::invalid_argument) when it assigns another number of units than
//! the request has; shard_group checks the rest (plan.hpp's validate() checks it against a
//! trace).
struct planned {
  schedule::plan value;

  std::vector<int> assign(const bucket_request& r) const { return checked(r).bucket_of_unit; }
  std::optional<schedule::plan> plan(const bucket_request& r) const { return checked(r); }

  friend bool operator==(const planned&, const planned&) = default;

 private:
  const schedule::plan& checked(const bucket_request& r) const {
    if (value.bucket_of_unit.size() != r.unit_bytes.size())
      throw error(errc::invalid_argument, "planned: plan '" + value.name + "' assigns " +
                                              std::to_string(value.bucket_of_unit.size()) + " units, the request has " +
                                              std::to_string(r.unit_bytes.size()));
    return value;
  }
};

static_assert(bucket_policy<planned>);
static_assert(planning_bucket_policy<planned>);

//! "planned{plan{.name = ..., ...}}".
inline std::string to_string(const planned& p) { return "planned{" + schedule::to_string(p.value) + "}"; }

}  // namespace fsdp
