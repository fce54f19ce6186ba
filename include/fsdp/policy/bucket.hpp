#pragma once
//! \file BucketPolicy: which units share one collective. A bucket is a run of consecutive
//! units (in registration order) whose parameters share one flat buffer, one all-gather and
//! one reduce-scatter.
//!
//!   per_unit{}                       one bucket per unit (FSDP2's default)
//!   fixed_bytes{.bytes = 64 << 20}   grow a bucket while it stays within the byte budget

#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace fsdp {

//! What a bucket policy sees when it chooses buckets. (The planner's automatic policy will
//! add the recorded trace and cost model here.)
struct bucket_request {
  std::span<const std::size_t> unit_bytes;  //!< unsharded bytes of each unit, in the param dtype
};

//! BucketPolicy. A type T models it when:
//!   1. b.assign(request) returns, for each unit, the index of its bucket; buckets are numbered
//!      0, 1, ... and hold consecutive units (the result is non-decreasing by 0 or 1 steps).
template <class T>
concept bucket_policy = requires(const T& b, const bucket_request& r) {
  { b.assign(r) } -> std::same_as<std::vector<int>>;
};

struct per_unit {
  std::vector<int> assign(const bucket_request& r) const {
    std::vector<int> out(r.unit_bytes.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int>(i);
    return out;
  }
  friend bool operator==(const per_unit&, const per_unit&) = default;
};

struct fixed_bytes {
  std::size_t bytes = std::size_t{64} << 20;  //!< budget per bucket; a larger unit stands alone
  std::vector<int> assign(const bucket_request& r) const {
    std::vector<int> out(r.unit_bytes.size());
    int bucket = -1;
    std::size_t filled = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (bucket < 0 || filled + r.unit_bytes[i] > bytes) {
        ++bucket;
        filled = 0;
      }
      filled += r.unit_bytes[i];
      out[i] = bucket;
    }
    return out;
  }
  friend bool operator==(const fixed_bytes&, const fixed_bytes&) = default;
};

static_assert(bucket_policy<per_unit>);
static_assert(bucket_policy<fixed_bytes>);

inline std::string to_string(const per_unit&) { return "per_unit"; }
inline std::string to_string(const fixed_bytes& b) { return "fixed_bytes{.bytes = " + std::to_string(b.bytes) + "}"; }

}  // namespace fsdp
