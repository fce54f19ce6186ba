#pragma once
//! \file unit_registry: the units a shard_group shards, what each holds, and the state machine
//! of its hooks. Pure host code: it checks and records, it moves no bytes.
//!
//! A unit's hooks run idle -> pre_forward -> forward -> post_forward -> idle (awaiting its
//! backward) -> pre_backward -> backward -> post_backward -> idle. Several forwards may await
//! their backwards (pipeline micro-batches: GPipe runs every forward first, 1F1B a few); each
//! backward answers one of them. Inside its backward a unit may re-run its forward
//! (activation recomputation): pre_forward -> recompute -> post_forward -> backward again. Any
//! other call is an errc::order error naming the unit and saying which step was missing or
//! repeated; the state is unchanged by a refused call.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/param_traits.hpp"
#include "fsdp/schedule/trace.hpp"

namespace fsdp::detail {

template <parameter Params>
class unit_registry {
 public:
  enum class state : std::uint8_t { idle, forward, backward, recompute };  // recompute: a forward inside its backward

  struct unit {
    std::vector<Params*> params;
    std::vector<bool> frozen;  // per parameter: no gradient, no reduction, no optimizer state
    std::vector<std::weak_ptr<const void>> lifetimes;  // per parameter, where the handle tracks it
    std::string name;
    int bucket = 0;
    std::size_t first_entry = 0;  // index of its first parameter in its bucket's layout
    state now = state::idle;
    int awaiting = 0;           // forwards of this pass whose backward has not run
    bool backward_ran = false;  // a backward ran since the pass began (for the error's words)
  };

  //! The largest parameter fsdp accepts: 2^40 elements (indices and byte counts stay exact).
  static constexpr std::size_t max_param_numel = std::size_t{1} << 40;

  explicit unit_registry(int rank) : rank_(rank) {}

  //! Checks one unit's parameters (not null, not registered before, a shardable dtype equal to
  //! `param_dtype`, 1 to max_param_numel elements) and appends it, with `frozen` (each one of
  //! `params`) marked frozen. Returns its index.
  int add(std::span<Params* const> params, std::string name, dtype param_dtype, std::span<Params* const> frozen = {}) {
    const int u = size();
    if (params.empty()) throw error(errc::invalid_argument, "a unit needs at least one parameter", site(u));
    unit rec;
    rec.name = name.empty() ? "unit" + std::to_string(u) : std::move(name);
    for (std::size_t i = 0; i < params.size(); ++i) {
      Params* p = params[i];
      if (p == nullptr) throw error(errc::invalid_argument, "parameter " + std::to_string(i) + " is null", site(u));
      const std::string pname = param_name(*p, i);
      for (std::size_t v = 0; v < units_.size(); ++v)
        if (std::find(units_[v].params.begin(), units_[v].params.end(), p) != units_[v].params.end())
          throw error(errc::invalid_argument, "registered twice (already in unit " + std::to_string(v) + ")", site(u, pname));
      if (std::find(rec.params.begin(), rec.params.end(), p) != rec.params.end())
        throw error(errc::invalid_argument, "registered twice in the same unit", site(u, pname));
      const dtype t = param_traits<Params>::type(*p);
      if (!is_shardable(t))
        throw error(errc::unsupported_dtype,
                    "dtype " + std::string(to_string(t)) + " cannot be sharded (supported: f32, bf16, f16)", site(u, pname));
      if (t != param_dtype)
        throw error(errc::unsupported_dtype,
                    "dtype " + std::string(to_string(t)) + " differs from the MixedPrecision param type " +
                        std::string(to_string(param_dtype)),
                    site(u, pname));
      const std::size_t n = param_traits<Params>::numel(*p);
      if (n == 0) throw error(errc::invalid_argument, "has 0 elements", site(u, pname));
      if (n > max_param_numel)
        throw error(errc::invalid_argument,
                    "has " + std::to_string(n) + " elements, more than fsdp's limit of " + std::to_string(max_param_numel),
                    site(u, pname));
      if constexpr (has_shape<Params>) {
        std::size_t product = 1;
        for (std::size_t d : param_traits<Params>::shape(*p)) product *= d;
        if (product != n)
          throw error(errc::invalid_argument, "its shape holds " + std::to_string(product) + " elements, its numel is " + std::to_string(n),
                      site(u, pname));
      }
      rec.params.push_back(p);
      rec.frozen.push_back(std::find(frozen.begin(), frozen.end(), p) != frozen.end());
      if constexpr (tracks_lifetime<Params>) rec.lifetimes.push_back(param_traits<Params>::lifetime(*p));
    }
    for (Params* f : frozen)
      if (std::find(rec.params.begin(), rec.params.end(), f) == rec.params.end())
        throw error(errc::invalid_argument, "a frozen parameter must be one of the unit's parameters", site(u, f ? param_name(*f, 0) : "null"));
    units_.push_back(std::move(rec));
    return u;
  }

  //! Whether parameter i of unit u may be written: false once a handle that tracks its lifetime
  //! (param_traits contract 7) was destroyed.
  bool alive(int u, std::size_t i) const noexcept {
    if constexpr (tracks_lifetime<Params>) return !(*this)[u].lifetimes[i].expired();
    return true;
  }
  //! Throws errc::order naming the first parameter of unit u whose handle was destroyed.
  void require_alive(int u) const {
    for (std::size_t i = 0; i < (*this)[u].params.size(); ++i)
      if (!alive(u, i))
        throw error(errc::order,
                    "parameter " + std::to_string(i) + "'s handle was destroyed while its "
                        "shard_group still uses it; declare the parameter handles before the group",
                    site(u));
  }
  //! Points every live parameter of unit u at nothing (a destroyed handle is skipped).
  void unbind(int u) noexcept {
    for (std::size_t i = 0; i < (*this)[u].params.size(); ++i)
      if (alive(u, i)) param_traits<Params>::bind(*(*this)[u].params[i], nullptr, nullptr);
  }

  int size() const noexcept { return static_cast<int>(units_.size()); }
  bool empty() const noexcept { return units_.empty(); }
  unit& operator[](int u) { return units_[static_cast<std::size_t>(u)]; }
  const unit& operator[](int u) const { return units_[static_cast<std::size_t>(u)]; }
  const unit& at(int u) const { return units_.at(static_cast<std::size_t>(u)); }

  //! Unsharded bytes of each unit in `elem`-byte elements (what a BucketPolicy sees).
  std::vector<std::size_t> bytes(std::size_t elem) const {
    std::vector<std::size_t> out;
    for (const auto& u : units_) {
      std::size_t n = 0;
      for (Params* p : u.params) n += param_traits<Params>::numel(*p);
      out.push_back(n * elem);
    }
    return out;
  }

  //! Each unit's name and parameter sizes, as a step_trace describes them (times left at 0).
  std::vector<schedule::unit_profile> profiles() const {
    std::vector<schedule::unit_profile> out;
    for (const auto& u : units_) {
      schedule::unit_profile p;
      p.name = u.name;
      for (Params* q : u.params) p.param_numels.push_back(param_traits<Params>::numel(*q));
      out.push_back(std::move(p));
    }
    return out;
  }

  // ---- the state machine: each returns the unit's bucket ------------------------------------

  //! A hook's unit index, checked: errc::invalid_argument naming the hook when out of range.
  unit& checked(int u, const char* hook) {
    if (u < 0 || u >= size())
      throw error(errc::invalid_argument,
                  std::string(hook) + ": no unit " + std::to_string(u) + " (" + std::to_string(size()) + " registered)", site());
    return (*this)[u];
  }
  int pre_forward(int u) {
    unit& r = checked(u, "pre_forward");
    if (r.now == state::forward || r.now == state::recompute)
      throw error(errc::order, "pre_forward called twice without post_forward", site(u));
    r.now = r.now == state::backward ? state::recompute : state::forward;
    return r.bucket;
  }
  int post_forward(int u) {
    unit& r = checked(u, "post_forward");
    if (r.now == state::recompute) {
      r.now = state::backward;
      return r.bucket;
    }
    if (r.now != state::forward) throw error(errc::order, "post_forward without pre_forward", site(u));
    r.now = state::idle;
    ++r.awaiting;
    return r.bucket;
  }
  int pre_backward(int u) {
    unit& r = checked(u, "pre_backward");
    if (r.now == state::backward) throw error(errc::order, "pre_backward called twice without post_backward", site(u));
    if (r.now == state::forward) throw error(errc::order, "pre_backward while the unit is in forward", site(u));
    if (r.now == state::recompute) throw error(errc::order, "pre_backward while the unit's recompute runs (post_forward missing)", site(u));
    if (r.awaiting == 0)
      throw error(errc::order, r.backward_ran ? "pre_backward called twice for one forward (the unit's backward already ran)"
                                              : "pre_backward before the unit's forward", site(u));
    r.now = state::backward;
    return r.bucket;
  }
  int post_backward(int u) {
    unit& r = checked(u, "post_backward");
    if (r.now == state::recompute) throw error(errc::order, "post_backward while the unit's recompute runs (post_forward missing)", site(u));
    if (r.now != state::backward) throw error(errc::order, "post_backward without pre_backward", site(u));
    r.now = state::idle;
    --r.awaiting;
    r.backward_ran = true;
    return r.bucket;
  }
  //! Whether unit u is inside its backward: a forward there (pre_forward to post_forward) is a recompute.
  bool in_backward(int u) const noexcept { return (*this)[u].now == state::backward || (*this)[u].now == state::recompute; }
  //! The check of an explicit recompute(u): u must be in its backward (errc::order otherwise,
  //! naming where it stands instead).
  void require_recompute_allowed(int u) {
    const unit& r = checked(u, "recompute");
    if (r.now == state::backward) return;
    const char* where = r.now == state::recompute          ? "recompute called twice without post_forward"
                        : r.now == state::forward          ? "recompute while the unit is in forward"
                        : r.awaiting > 0                   ? "recompute before the unit's backward"
                        : r.backward_ran                   ? "recompute of a unit whose backward already ran"
                                                           : "recompute during the forward pass, before the unit's forward";
    throw error(errc::order, std::string(where) + " (a recompute re-runs the forward inside the unit's own backward: "
                             "between pre_backward and post_backward)", site(u));
  }
  //! Throws errc::order naming the first unit still between its pre and post hooks.
  void require_idle(const char* what) const {
    for (int u = 0; u < size(); ++u)
      if ((*this)[u].now != state::idle)
        throw error(errc::order, std::string(what) + " while the unit is still between its pre and post hooks", site(u));
  }
  //! A pass ended: no unit awaits its backward any more, and the next pre_backward of any unit
  //! comes before its forward.
  void end_pass() {
    for (auto& u : units_) u.awaiting = 0, u.backward_ran = false;
  }

  // ---- what every rank must agree on --------------------------------------------------------

  //! The registration as numbers: unit count, then per unit its parameter count and each
  //! parameter's (numel, dtype + frozen_flag when frozen).
  std::vector<std::uint64_t> describe() const {
    std::vector<std::uint64_t> desc{units_.size()};
    for (const auto& u : units_) {
      desc.push_back(u.params.size());
      for (std::size_t i = 0; i < u.params.size(); ++i) {
        desc.push_back(param_traits<Params>::numel(*u.params[i]));
        desc.push_back(static_cast<std::uint64_t>(param_traits<Params>::type(*u.params[i])) + (u.frozen[i] ? frozen_flag : 0));
      }
    }
    return desc;
  }

  //! Names the first unit, and parameter, where two ranks' registrations (their describe())
  //! part: `odd` of rank odd_rank, `ref` of rank ref_rank. Both ranks are named, so every rank
  //! gives the same sentence; parameter names are this rank's, given when this rank registered
  //! like one of the two.
  std::string describe_difference(int odd_rank, std::span<const std::uint64_t> odd, int ref_rank,
                                  std::span<const std::uint64_t> ref) const {
    const auto a = parse(odd), b = parse(ref);
    const std::vector<std::uint64_t> mine = describe();
    const bool named = std::ranges::equal(mine, odd) || std::ranges::equal(mine, ref);
    const std::string ro = "rank " + std::to_string(odd_rank), rr = "rank " + std::to_string(ref_rank);
    const std::string head = "ranks registered different parameters: ";
    std::string counts = ro;
    counts.append(" registered ").append(count(a.size(), "unit")).append(", ").append(rr).append(" ").append(std::to_string(b.size()));
    const std::size_t common = std::min(a.size(), b.size());
    for (std::size_t u = 0; u < common; ++u) {
      const std::string unit_s = "unit " + std::to_string(u);
      if (a[u].size() != b[u].size()) {
        std::string m = head + unit_s + ": " + ro + " registered " + count(a[u].size(), "parameter") + ", " + rr + " " +
                        std::to_string(b[u].size());
        if (a.size() != b.size()) m.append(" (").append(counts).append(")");
        return m;
      }
      for (std::size_t k = 0; k < a[u].size(); ++k) {
        if (a[u][k] == b[u][k]) continue;
        std::string name;
        if (named && u < units_.size() && k < units_[u].params.size())
          name = " ('" + param_name(*units_[u].params[k], k) + "')";
        return head + unit_s + " parameter " + std::to_string(k) + name + ": " + ro + " registered " +
               std::to_string(a[u][k].first) + " elements of " + dtype_name(a[u][k].second) + ", " + rr + " " +
               std::to_string(b[u][k].first) + " of " + dtype_name(b[u][k].second);
      }
    }
    if (a.size() != b.size()) {
      const bool on_odd = a.size() > b.size();
      const auto& extra = on_odd ? a : b;
      return head + "unit " + std::to_string(common) + " (" + count(extra[common].size(), "parameter") + ") is registered on " +
             (on_odd ? ro : rr) + " but not on " + (on_odd ? rr : ro) + " (" + counts + ")";
    }
    return head + ro + " and " + rr;  // not reached: describe() values that differ part somewhere
  }

  //! A parameter's name for messages: its param_traits name, else "#<index in its unit>".
  static std::string param_name(const Params& p, std::size_t i) {
    const std::string_view n = param_traits<Params>::name(p);
    if (!n.empty()) return std::string(n);
    std::string s(1, '#');  // not "#" + std::to_string(i): GCC 12 -O3 warns falsely (-Wrestrict)
    s += std::to_string(i);
    return s;
  }

 private:
  error_site site(int u = -1, std::string p = {}) const { return {rank_, u, std::move(p)}; }

  // describe() back into per unit, per parameter (numel, dtype); stops at a short vector.
  using param_desc = std::pair<std::uint64_t, std::uint64_t>;
  static std::vector<std::vector<param_desc>> parse(std::span<const std::uint64_t> d) {
    std::vector<std::vector<param_desc>> units;
    if (d.empty()) return units;
    std::size_t i = 1;
    for (std::uint64_t u = 0; u < d[0] && i < d.size(); ++u) {
      const std::uint64_t n = d[i++];
      auto& params = units.emplace_back();
      for (std::uint64_t k = 0; k < n && i + 1 < d.size(); ++k, i += 2) params.emplace_back(d[i], d[i + 1]);
    }
    return units;
  }
  static constexpr std::uint64_t frozen_flag = 256;  // above every dtype value
  static std::string dtype_name(std::uint64_t t) {
    std::string s = t & frozen_flag ? "frozen " : "";
    s += to_string(static_cast<dtype>(t & ~frozen_flag));
    return s;
  }
  // "1 parameter", "3 parameters"
  static std::string count(std::size_t n, const char* noun) {
    std::string s = std::to_string(n);
    s.append(" ").append(noun);
    if (n != 1) s.append("s");
    return s;
  }

  int rank_;
  std::vector<unit> units_;
};

}  // namespace fsdp::detail
