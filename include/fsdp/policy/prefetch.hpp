#pragma once
//! \file Prefetch: how early the next all-gathers are issued, which bounds in-flight memory.
//!
//!   no_prefetch{}                                   gather each bucket when it is needed
//!   prefetch{.forward = 1, .backward = 1}           keep 1 bucket ahead in each direction
//!   prefetch{.forward = 2, .forward_order = {...}}  an explicit unit order instead of the
//!                                                   order recorded in the first step

#include <concepts>
#include <span>
#include <string>
#include <vector>

namespace fsdp {

//! Prefetch. A type T models it when:
//!   1. p.forward_depth() and p.backward_depth() give how many buckets past the one in use
//!      may be gathered ahead (>= 0);
//!   2. p.forward_order() and p.backward_order() give an explicit unit order (a span of unit
//!      indices); an empty span means "the order recorded in the first step".
template <class T>
concept prefetch_policy = requires(const T& p) {
  { p.forward_depth() } -> std::convertible_to<int>;
  { p.backward_depth() } -> std::convertible_to<int>;
  { p.forward_order() } -> std::convertible_to<std::span<const int>>;
  { p.backward_order() } -> std::convertible_to<std::span<const int>>;
};

struct no_prefetch {
  int forward_depth() const noexcept { return 0; }
  int backward_depth() const noexcept { return 0; }
  std::span<const int> forward_order() const noexcept { return {}; }
  std::span<const int> backward_order() const noexcept { return {}; }
  friend bool operator==(const no_prefetch&, const no_prefetch&) = default;
};

struct prefetch {
  int forward = 1;
  int backward = 1;
  std::vector<int> forward_units{};   //!< explicit forward unit order (empty: recorded)
  std::vector<int> backward_units{};  //!< explicit backward unit order (empty: recorded)
  int forward_depth() const noexcept { return forward; }
  int backward_depth() const noexcept { return backward; }
  std::span<const int> forward_order() const noexcept { return forward_units; }
  std::span<const int> backward_order() const noexcept { return backward_units; }
  friend bool operator==(const prefetch&, const prefetch&) = default;
};

static_assert(prefetch_policy<no_prefetch>);
static_assert(prefetch_policy<prefetch>);

inline std::string to_string(const no_prefetch&) { return "no_prefetch"; }
inline std::string to_string(const prefetch& p) {
  return "prefetch{.forward = " + std::to_string(p.forward) + ", .backward = " + std::to_string(p.backward) +
         (p.forward_units.empty() && p.backward_units.empty() ? "}" : ", explicit order}");
}

}  // namespace fsdp
