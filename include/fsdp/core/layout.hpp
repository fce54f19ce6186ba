#pragma once
//! \file Flat-buffer layout math: where each parameter sits in its bucket's flat buffer, how
//! much padding the buffer gets, and which slices each rank owns.
//!
//!   flat buffer: p0 | pad | p1 | pad | ... | pad to a multiple of lcm(world, 128)
//!   shard r:     [r * n / S, (r + 1) * n / S)      (S = shard count, n = padded numel)
//!
//! Each parameter starts on a 64-element boundary; the padded size is a multiple of
//! lcm(world size, 128) elements, as Megatron pads its buckets for NCCL bus bandwidth. That
//! makes every shard the same size (NCCL's in-place all-gather and reduce-scatter need it) and
//! every per-rank traffic figure an exact integer.
//!
//! Frozen parameters (no gradient, no optimizer state) get a region of their own after the
//! trainable ones, padded the same way, so the gradients, their reduce-scatter and the
//! optimizer cover the trainable region alone (as Megatron-FSDP groups its buckets by
//! requires_grad). Each region is split into S equal chunks; rank r's shard is its chunk of
//! every region, trainable chunk first:
//!
//!   flat buffer: [ trainable: T elements ][ frozen: F elements ]
//!   shard r:     [ T/S trainable          ][ F/S frozen         ]

#include <algorithm>
#include <cstddef>
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"

namespace fsdp {

//! Every parameter starts at a multiple of this many elements inside its flat buffer.
inline constexpr std::size_t param_alignment = 64;
//! A flat buffer's padded size is a multiple of lcm(world size, bucket_granularity) elements.
inline constexpr std::size_t bucket_granularity = 128;

namespace detail {
inline std::size_t checked_add(std::size_t a, std::size_t b, const char* what) {
  if (a > std::numeric_limits<std::size_t>::max() - b)
    throw error(errc::invalid_argument, std::string(what) + " overflows the size type");
  return a + b;
}
inline std::size_t round_up(std::size_t n, std::size_t multiple, const char* what) {
  const std::size_t r = n % multiple;
  return r == 0 ? n : checked_add(n, multiple - r, what);
}
}  // namespace detail

//! The padding multiple for a run over `world_size` ranks: lcm(world_size, 128).
inline std::size_t padding_multiple(int world_size) {
  if (world_size < 1) throw error(errc::invalid_argument, "world size must be at least 1");
  return std::lcm(static_cast<std::size_t>(world_size), bucket_granularity);
}

//! One parameter's place in a flat buffer (element offsets).
struct flat_entry {
  std::size_t offset = 0;
  std::size_t numel = 0;
  friend bool operator==(const flat_entry&, const flat_entry&) = default;
};

//! [begin, end) in elements of a flat buffer.
struct flat_range {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::size_t size() const noexcept { return end - begin; }
  friend bool operator==(const flat_range&, const flat_range&) = default;
};

//! The part of one parameter that lies inside one shard.
struct shard_slice {
  std::size_t param_offset = 0;  //!< first element of the parameter that is in the shard
  std::size_t shard_offset = 0;  //!< where that element sits inside the shard
  std::size_t numel = 0;         //!< how many consecutive elements
  friend bool operator==(const shard_slice&, const shard_slice&) = default;
};

//! A run of the flat buffer whose parameters are all trainable or all frozen: elements
//! [offset, offset + numel) of the buffer; rank r holds its chunk r (numel / S elements) at
//! shard_offset in its shard.
struct flat_region {
  std::size_t offset = 0;
  std::size_t numel = 0;
  std::size_t shard_offset = 0;
  bool frozen = false;
  friend bool operator==(const flat_region&, const flat_region&) = default;
};

//! Layout of a flat buffer holding parameters of the given sizes (those with frozen[i] set in
//! a region of their own after the others), each region split into `shards` equal chunks.
//! Throws fsdp::error on a zero-size parameter, a shard count that does not divide the padding
//! multiple, a frozen list of the wrong length, or sizes that overflow.
class flat_layout {
 public:
  flat_layout() = default;
  flat_layout(std::span<const std::size_t> numels, int shards, std::size_t pad_multiple, const std::vector<bool>& frozen = {})
      : shards_(shards) {
    if (shards < 1) throw error(errc::invalid_argument, "shard count must be at least 1");
    if (pad_multiple == 0 || pad_multiple % static_cast<std::size_t>(shards) != 0)
      throw error(errc::invalid_argument, "padding multiple " + std::to_string(pad_multiple) +
                                              " is not a multiple of the shard count " +
                                              std::to_string(shards));
    if (!frozen.empty() && frozen.size() != numels.size())
      throw error(errc::invalid_argument, "flat layout: " + std::to_string(frozen.size()) + " frozen flags for " +
                                              std::to_string(numels.size()) + " parameters");
    entries_.resize(numels.size());
    frozen_.assign(numels.size(), false);
    const bool any_frozen = std::find(frozen.begin(), frozen.end(), true) != frozen.end();
    std::size_t cursor = 0;
    for (const bool region_frozen : {false, true}) {
      const std::size_t begin = cursor;
      bool any = false;
      for (std::size_t i = 0; i < numels.size(); ++i) {
        if ((!frozen.empty() && frozen[i]) != region_frozen) continue;
        if (numels[i] == 0)
          throw error(errc::invalid_argument,
                      "parameter " + std::to_string(i) + " of the flat buffer has 0 elements");
        any = true;
        frozen_[i] = region_frozen;
        cursor = detail::round_up(cursor, param_alignment, "flat buffer size");
        entries_[i] = {cursor, numels[i]};
        cursor = detail::checked_add(cursor, numels[i], "flat buffer size");
      }
      // An empty trainable region stays empty unless nothing else is there (a bucket of no
      // parameters keeps one padded chunk, as before regions existed).
      if (!any && (region_frozen || any_frozen)) continue;
      cursor = begin + detail::round_up(std::max<std::size_t>(cursor - begin, 1), pad_multiple, "flat buffer size");
      regions_.push_back({begin, cursor - begin, shard_numel_, region_frozen});
      shard_numel_ += (cursor - begin) / static_cast<std::size_t>(shards);
    }
    padded_ = cursor;
  }

  std::span<const flat_entry> entries() const noexcept { return entries_; }
  std::size_t size() const noexcept { return entries_.size(); }
  const flat_entry& operator[](std::size_t i) const { return entries_.at(i); }
  //! Elements in the padded flat buffer (a multiple of the padding multiple).
  std::size_t padded_numel() const noexcept { return padded_; }
  //! Elements that belong to parameters (no padding).
  std::size_t param_numel() const noexcept {
    std::size_t n = 0;
    for (const auto& e : entries_) n += e.numel;
    return n;
  }
  int shards() const noexcept { return shards_; }
  //! Elements of each rank's shard: its chunk of every region.
  std::size_t shard_numel() const noexcept { return shard_numel_; }
  //! The regions, trainable first; one when no parameter is frozen (or every one is).
  std::span<const flat_region> regions() const noexcept { return regions_; }
  bool frozen(std::size_t i) const { return frozen_.at(i); }
  //! Padded elements of the trainable region, which starts the buffer (0: every parameter is
  //! frozen). Gradients cover these; the first trainable_numel() / S of a shard are its part.
  std::size_t trainable_numel() const noexcept { return regions_.empty() || regions_[0].frozen ? 0 : regions_[0].numel; }
  std::size_t trainable_shard_numel() const noexcept { return trainable_numel() / static_cast<std::size_t>(shards_); }
  //! Rank r's chunk of region `region` (the whole shard when there is one region).
  flat_range shard(int r, std::size_t region = 0) const {
    const flat_region& g = regions_.at(region);
    const std::size_t n = g.numel / static_cast<std::size_t>(shards_);
    return {g.offset + static_cast<std::size_t>(r) * n, g.offset + static_cast<std::size_t>(r + 1) * n};
  }
  //! Where element k of rank r's shard sits in the flat buffer.
  std::size_t position(int r, std::size_t k) const {
    for (std::size_t g = regions_.size(); g-- > 0;)
      if (k >= regions_[g].shard_offset) return shard(r, g).begin + (k - regions_[g].shard_offset);
    return k;
  }
  //! The parameter whose elements hold flat position `at` (none: padding). A scan: for naming
  //! what an element is (a non-finite gradient), not for per-element loops.
  std::optional<std::size_t> entry_at(std::size_t at) const {
    for (std::size_t e = 0; e < entries_.size(); ++e)
      if (at >= entries_[e].offset && at < entries_[e].offset + entries_[e].numel) return e;
    return std::nullopt;
  }
  //! The part of parameter i inside shard r, if any.
  std::optional<shard_slice> slice(std::size_t i, int r) const {
    const flat_entry& e = entries_.at(i);
    const std::size_t g = frozen_[i] && regions_.size() > 1 ? 1 : 0;
    const flat_range s = shard(r, g);
    const std::size_t b = std::max(e.offset, s.begin);
    const std::size_t end = std::min(e.offset + e.numel, s.end);
    if (b >= end) return std::nullopt;
    return shard_slice{b - e.offset, regions_[g].shard_offset + (b - s.begin), end - b};
  }

 private:
  std::vector<flat_entry> entries_;
  std::vector<bool> frozen_;
  std::vector<flat_region> regions_;
  std::size_t padded_ = 0;
  std::size_t shard_numel_ = 0;
  int shards_ = 1;
};

}  // namespace fsdp
