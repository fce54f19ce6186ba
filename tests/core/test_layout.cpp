// Property and error tests of the flat-buffer layout math (core/layout.hpp). Expected values
// come from plain loops over the sizes, never from the layout under test.

#include "fsdp/core/layout.hpp"

#include <doctest/doctest.h>

#include "common/catch_error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"

namespace {

constexpr std::size_t size_max = std::numeric_limits<std::size_t>::max();

// Smallest positive multiple of 128 that n divides: lcm(n, 128) by search, not by formula.
std::size_t lcm_with_128(std::size_t n) {
  std::size_t m = 128;
  while (m % n != 0) m += 128;
  return m;
}

// A few hundred parameter-size lists with a fixed seed: tiny, odd, exact multiples of the
// alignment and of the granularity, and a few larger ones.
std::vector<std::vector<std::size_t>> random_size_lists() {
  std::mt19937 rng(0x5eed1234u);
  std::vector<std::vector<std::size_t>> out;
  for (int k = 0; k < 300; ++k) {
    std::vector<std::size_t> sizes(1 + rng() % 9);
    for (auto& n : sizes) {
      switch (rng() % 5) {
        case 0: n = 1 + rng() % 8; break;
        case 1: n = 1 + rng() % 300; break;
        case 2: n = 64 * (1 + rng() % 20); break;
        case 3: n = 128 * (1 + rng() % 10) + (rng() % 3) - 1; break;  // around multiples of 128
        default: n = 1 + rng() % 2500; break;
      }
    }
    out.push_back(std::move(sizes));
  }
  // Hand-picked edges: a single element, exact lcm sizes, alignment +- 1.
  out.push_back({1});
  out.push_back({64});
  out.push_back({63, 1, 65});
  out.push_back({128});
  out.push_back({896});
  out.push_back({1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  return out;
}

// Built by appending: "," + std::to_string(...) hits GCC 12's false -Wrestrict at -O3 (GCC bugs
// 105329, 105651).
std::string describe(const std::vector<std::size_t>& sizes, int shards) {
  std::string s = "shards=";
  s.append(std::to_string(shards)).append(" sizes={");
  for (std::size_t i = 0; i < sizes.size(); ++i) s.append(i ? "," : "").append(std::to_string(sizes[i]));
  s.append("}");
  return s;
}

template <class F>
void for_each_case(F&& f) {
  for (const auto& sizes : random_size_lists())
    for (int n = 1; n <= 8; ++n) {
      const fsdp::flat_layout layout(sizes, n, fsdp::padding_multiple(n));
      f(sizes, n, layout);
    }
}

using fsdp_test::catch_error;

}  // namespace

TEST_CASE("padding_multiple is lcm(N, 128) and rejects N < 1") {
  for (int n = 1; n <= 64; ++n) {
    INFO("N = " << n);
    CHECK(fsdp::padding_multiple(n) == lcm_with_128(static_cast<std::size_t>(n)));
  }
  CHECK(fsdp::padding_multiple(1) == 128);
  CHECK(fsdp::padding_multiple(3) == 384);
  CHECK(fsdp::padding_multiple(6) == 384);
  CHECK(fsdp::padding_multiple(7) == 896);
  CHECK(fsdp::padding_multiple(8) == 128);
  CHECK(fsdp::padding_multiple(256) == 256);
  for (int bad : {0, -1, -128}) {
    INFO("N = " << bad);
    const auto e = catch_error([&] { (void)fsdp::padding_multiple(bad); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
  }
}

TEST_CASE("layout: parameters are 64-aligned, in order, tightly packed and do not overlap") {
  for_each_case([](const std::vector<std::size_t>& sizes, int n, const fsdp::flat_layout& layout) {
    INFO(describe(sizes, n));
    REQUIRE(layout.size() == sizes.size());
    REQUIRE(layout.entries().size() == sizes.size());
    std::size_t prev_end = 0;
    std::size_t total = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const fsdp::flat_entry& e = layout.entries()[i];
      INFO("parameter " << i << " at " << e.offset);
      CHECK(e.numel == sizes[i]);
      CHECK(e.offset % 64 == 0);
      CHECK(e.offset >= prev_end);       // in order, no overlap with the previous one
      CHECK(e.offset - prev_end < 64);   // no gap beyond the alignment padding
      CHECK(layout[i] == e);
      prev_end = e.offset + e.numel;
      total += sizes[i];
    }
    CHECK(layout.entries()[0].offset == 0);
    CHECK(layout.param_numel() == total);
  });
}

TEST_CASE("layout: padded size is the smallest multiple of lcm(N, 128) that holds every parameter") {
  for_each_case([](const std::vector<std::size_t>& sizes, int n, const fsdp::flat_layout& layout) {
    INFO(describe(sizes, n));
    const std::size_t pad = lcm_with_128(static_cast<std::size_t>(n));
    const fsdp::flat_entry& last = layout.entries().back();
    const std::size_t end = last.offset + last.numel;
    CHECK(layout.padded_numel() % pad == 0);
    CHECK(layout.padded_numel() % static_cast<std::size_t>(n) == 0);
    CHECK(layout.padded_numel() >= end);
    CHECK(layout.padded_numel() - end < pad);
    CHECK(layout.padded_numel() >= layout.param_numel());
  });
}

TEST_CASE("layout: shards are equal, contiguous and tile the padded buffer") {
  for_each_case([](const std::vector<std::size_t>& sizes, int n, const fsdp::flat_layout& layout) {
    INFO(describe(sizes, n));
    CHECK(layout.shards() == n);
    const std::size_t per = layout.padded_numel() / static_cast<std::size_t>(n);
    CHECK(layout.shard_numel() == per);
    CHECK(layout.shard(0).begin == 0);
    CHECK(layout.shard(n - 1).end == layout.padded_numel());
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r);
      const fsdp::flat_range s = layout.shard(r);
      CHECK(s.begin == static_cast<std::size_t>(r) * per);
      CHECK(s.size() == per);
      CHECK(s.end - s.begin == per);
      if (r + 1 < n) CHECK(s.end == layout.shard(r + 1).begin);
    }
  });
}

TEST_CASE("layout: slices of a parameter over all shards cover it exactly once") {
  for_each_case([](const std::vector<std::size_t>& sizes, int n, const fsdp::flat_layout& layout) {
    INFO(describe(sizes, n));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const fsdp::flat_entry e = layout[i];
      std::vector<int> hits(e.numel, 0);
      std::size_t covered = 0;
      std::size_t next = 0;  // slices come in rank order and continue where the last one ended
      for (int r = 0; r < n; ++r) {
        INFO("parameter " << i << ", rank " << r);
        const fsdp::flat_range s = layout.shard(r);
        const bool intersects = e.offset < s.end && s.begin < e.offset + e.numel;
        const std::optional<fsdp::shard_slice> sl = layout.slice(i, r);
        REQUIRE(sl.has_value() == intersects);
        if (!sl) continue;
        CHECK(sl->numel > 0);
        CHECK(sl->param_offset == next);
        CHECK(sl->param_offset + sl->numel <= e.numel);
        CHECK(sl->shard_offset + sl->numel <= s.size());
        // The same flat position seen from the parameter and from the shard.
        CHECK(s.begin + sl->shard_offset == e.offset + sl->param_offset);
        // Maximal: the slice is the whole intersection.
        CHECK(sl->numel == std::min(e.offset + e.numel, s.end) - std::max(e.offset, s.begin));
        for (std::size_t k = 0; k < sl->numel && sl->param_offset + k < e.numel; ++k)
          ++hits[sl->param_offset + k];
        covered += sl->numel;
        next = sl->param_offset + sl->numel;
      }
      CHECK(covered == e.numel);
      CHECK(std::count(hits.begin(), hits.end(), 1) == static_cast<std::ptrdiff_t>(e.numel));
    }
  });
}

TEST_CASE("layout: padding elements are never part of any parameter") {
  for_each_case([](const std::vector<std::size_t>& sizes, int n, const fsdp::flat_layout& layout) {
    INFO(describe(sizes, n));
    std::vector<int> owner(layout.padded_numel(), -1);
    std::size_t double_owned = 0;
    std::size_t out_of_range = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const fsdp::flat_entry e = layout[i];
      for (std::size_t k = 0; k < e.numel; ++k) {
        const std::size_t p = e.offset + k;
        if (p >= owner.size()) {
          ++out_of_range;
          continue;
        }
        if (owner[p] != -1) ++double_owned;
        owner[p] = static_cast<int>(i);
      }
    }
    CHECK(out_of_range == 0);
    CHECK(double_owned == 0);
    std::size_t total = 0;
    for (auto s : sizes) total += s;
    const auto padding = static_cast<std::size_t>(std::count(owner.begin(), owner.end(), -1));
    CHECK(padding == layout.padded_numel() - total);
  });
}

TEST_CASE("layout: gathering the shards reproduces the parameters bit for bit") {
  std::mt19937 rng(42);
  for_each_case([&](const std::vector<std::size_t>& sizes, int n, const fsdp::flat_layout& layout) {
    INFO(describe(sizes, n));
    // The parameters: random float bit patterns (NaNs included), compared as bits.
    std::vector<std::vector<std::uint32_t>> params(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      params[i].resize(sizes[i]);
      for (auto& b : params[i]) b = static_cast<std::uint32_t>(rng());
    }
    // Lay them into a zeroed flat buffer of floats.
    std::vector<float> flat(layout.padded_numel(), 0.0f);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      std::memcpy(flat.data() + layout[i].offset, params[i].data(), sizes[i] * sizeof(float));
    // Shard: rank r keeps its contiguous slice.
    std::vector<std::vector<float>> shards(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      const fsdp::flat_range s = layout.shard(r);
      shards[static_cast<std::size_t>(r)].assign(flat.begin() + static_cast<std::ptrdiff_t>(s.begin),
                                                 flat.begin() + static_cast<std::ptrdiff_t>(s.end));
    }
    // Gather: concatenate the shards in rank order.
    std::vector<float> gathered;
    for (const auto& s : shards) gathered.insert(gathered.end(), s.begin(), s.end());
    REQUIRE(gathered.size() == layout.padded_numel());
    std::size_t param_mismatch = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      if (std::memcmp(gathered.data() + layout[i].offset, params[i].data(), sizes[i] * sizeof(float)) != 0)
        ++param_mismatch;
    CHECK(param_mismatch == 0);
    CHECK(std::memcmp(gathered.data(), flat.data(), flat.size() * sizeof(float)) == 0);

    // The same parameters rebuilt from the shards through slice() only (what an owner of a
    // shard uses to find its part of each parameter).
    std::size_t slice_mismatch = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<std::uint32_t> rebuilt(sizes[i], 0xdeadbeefu);
      for (int r = 0; r < n; ++r) {
        const auto sl = layout.slice(i, r);
        if (!sl) continue;
        const auto& shard = shards[static_cast<std::size_t>(r)];
        if (sl->shard_offset + sl->numel > shard.size() || sl->param_offset + sl->numel > sizes[i]) {
          ++slice_mismatch;
          continue;
        }
        std::memcpy(rebuilt.data() + sl->param_offset, shard.data() + sl->shard_offset,
                    sl->numel * sizeof(float));
      }
      if (rebuilt != params[i]) ++slice_mismatch;
    }
    CHECK(slice_mismatch == 0);
  });
}

TEST_CASE("layout: a hand-checked example") {
  // 100 at 0, 64 at 128, 1 at 192; end 193 -> padded 384 for N = 3 (lcm 384), shards of 128.
  const std::vector<std::size_t> sizes{100, 64, 1};
  const fsdp::flat_layout layout(sizes, 3, fsdp::padding_multiple(3));
  CHECK(layout[0] == fsdp::flat_entry{0, 100});
  CHECK(layout[1] == fsdp::flat_entry{128, 64});
  CHECK(layout[2] == fsdp::flat_entry{192, 1});
  CHECK(layout.padded_numel() == 384);
  CHECK(layout.shard_numel() == 128);
  CHECK(layout.param_numel() == 165);
  CHECK(layout.shard(1) == fsdp::flat_range{128, 256});
  CHECK(layout.slice(0, 0) == fsdp::shard_slice{0, 0, 100});
  CHECK_FALSE(layout.slice(0, 1).has_value());
  CHECK(layout.slice(1, 1) == fsdp::shard_slice{0, 0, 64});
  CHECK(layout.slice(2, 1) == fsdp::shard_slice{0, 64, 1});
  CHECK_FALSE(layout.slice(2, 2).has_value());
  CHECK_THROWS_AS((void)layout[3], std::out_of_range);

  // A parameter straddling two shards: 200 elements, N = 2 -> padded 256, shards of 128.
  const std::vector<std::size_t> one{200};
  const fsdp::flat_layout l2(one, 2, fsdp::padding_multiple(2));
  CHECK(l2.padded_numel() == 256);
  CHECK(l2.slice(0, 0) == fsdp::shard_slice{0, 0, 128});
  CHECK(l2.slice(0, 1) == fsdp::shard_slice{128, 0, 72});
}

TEST_CASE("layout: no parameters still gives one padded, shardable buffer") {
  for (int n = 1; n <= 8; ++n) {
    const fsdp::flat_layout layout(std::span<const std::size_t>{}, n, fsdp::padding_multiple(n));
    CHECK(layout.size() == 0);
    CHECK(layout.param_numel() == 0);
    CHECK(layout.padded_numel() % lcm_with_128(static_cast<std::size_t>(n)) == 0);
    CHECK(layout.shard_numel() * static_cast<std::size_t>(n) == layout.padded_numel());
  }
}

TEST_CASE("layout errors: a zero-size parameter is rejected, naming its index") {
  const std::vector<std::size_t> sizes{10, 20, 0, 5};
  const auto e = catch_error([&] { fsdp::flat_layout(sizes, 2, fsdp::padding_multiple(2)); });
  CHECK(e.code() == fsdp::errc::invalid_argument);
  CHECK(std::string(e.what()).find("parameter 2") != std::string::npos);
  CHECK(std::string(e.what()).find("0 elements") != std::string::npos);

  const std::vector<std::size_t> first{0};
  const auto e0 = catch_error([&] { fsdp::flat_layout(first, 1, fsdp::padding_multiple(1)); });
  CHECK(e0.code() == fsdp::errc::invalid_argument);
  CHECK(std::string(e0.what()).find("parameter 0") != std::string::npos);
}

TEST_CASE("layout errors: a shard count that does not divide the padding multiple") {
  const std::vector<std::size_t> sizes{10, 20};
  struct bad_case {
    int shards;
    std::size_t pad;
  };
  for (const bad_case c : {bad_case{3, 128}, bad_case{5, 128}, bad_case{7, 384}, bad_case{2, 0},
                           bad_case{1, 0}, bad_case{0, 128}, bad_case{-2, 128}}) {
    INFO("shards " << c.shards << ", pad " << c.pad);
    const auto e = catch_error([&] { fsdp::flat_layout(sizes, c.shards, c.pad); });
    CHECK(e.code() == fsdp::errc::invalid_argument);
  }
  // A pad multiple that the shard count divides is fine even if it is not lcm(N, 128).
  CHECK_NOTHROW(fsdp::flat_layout(sizes, 3, 3));
  CHECK(fsdp::flat_layout(sizes, 3, 3).padded_numel() % 3 == 0);
}

TEST_CASE("layout errors: sizes that overflow size_t") {
  const std::vector<std::vector<std::size_t>> cases{
      {size_max},
      {size_max - 1},
      {size_max - 100},              // fits, but padding to 128 overflows
      {1, size_max - 64},            // the second parameter starts at 64
      {size_max - 10, 5},            // aligning the second parameter overflows
      {size_max / 2, size_max / 2},  // padding the total overflows
      {size_max / 2 + 1, size_max / 2 + 1},
      {size_max / 4, size_max / 4, size_max / 4, size_max / 4, 1},
  };
  for (const auto& sizes : cases) {
    for (int n : {1, 3, 8}) {
      INFO(describe(sizes, n));
      const auto e = catch_error([&] { fsdp::flat_layout(sizes, n, fsdp::padding_multiple(n)); });
      CHECK(e.code() == fsdp::errc::invalid_argument);
      CHECK(std::string(e.what()).find("overflow") != std::string::npos);
    }
  }
}

TEST_CASE("layout: frozen parameters get a region after the trainable ones; a shard is its chunk of each (hand-checked)") {
  // Trainable 100 and 1 at 0 and 128 (end 129 -> 256 for N = 2); frozen 300 at 256 (-> 256 + 384).
  const std::vector<std::size_t> sizes{100, 300, 1};
  const fsdp::flat_layout layout(sizes, 2, fsdp::padding_multiple(2), {false, true, false});
  CHECK(layout[0] == fsdp::flat_entry{0, 100});
  CHECK(layout[1] == fsdp::flat_entry{256, 300});
  CHECK(layout[2] == fsdp::flat_entry{128, 1});
  REQUIRE(layout.regions().size() == 2);
  CHECK(layout.regions()[0] == fsdp::flat_region{0, 256, 0, false});
  CHECK(layout.regions()[1] == fsdp::flat_region{256, 384, 128, true});
  CHECK(layout.padded_numel() == 640);
  CHECK(layout.shard_numel() == 320);  // 128 trainable + 192 frozen
  CHECK(layout.trainable_numel() == 256);
  CHECK(layout.trainable_shard_numel() == 128);
  CHECK(layout.frozen(1));
  CHECK_FALSE(layout.frozen(2));
  CHECK(layout.shard(1, 0) == fsdp::flat_range{128, 256});
  CHECK(layout.shard(1, 1) == fsdp::flat_range{448, 640});
  CHECK(layout.slice(0, 0) == fsdp::shard_slice{0, 0, 100});
  CHECK(layout.slice(2, 1) == fsdp::shard_slice{0, 0, 1});
  CHECK(layout.slice(1, 0) == fsdp::shard_slice{0, 128, 192});  // frozen: after rank 0's trainable chunk
  CHECK(layout.slice(1, 1) == fsdp::shard_slice{192, 128, 108});
  CHECK(layout.position(1, 0) == 128);
  CHECK(layout.position(1, 130) == 450);

  // Every parameter frozen: one frozen region, nothing trainable.
  const fsdp::flat_layout all(sizes, 2, fsdp::padding_multiple(2), {true, true, true});
  REQUIRE(all.regions().size() == 1);
  CHECK(all.regions()[0].frozen);
  CHECK(all.trainable_numel() == 0);
  CHECK(all.trainable_shard_numel() == 0);
  CHECK(all.slice(1, 0) == fsdp::shard_slice{0, 128, 128});  // 100 at 0, 300 at 128, 1 at 448; padded 512

  // No parameter frozen: the layout without flags, one region.
  const fsdp::flat_layout none(sizes, 2, fsdp::padding_multiple(2), {false, false, false});
  const fsdp::flat_layout plain(sizes, 2, fsdp::padding_multiple(2));
  REQUIRE(none.regions().size() == 1);
  CHECK(none.padded_numel() == plain.padded_numel());
  CHECK(none.trainable_numel() == plain.padded_numel());
  for (std::size_t i = 0; i < sizes.size(); ++i) CHECK(none.slice(i, 1) == plain.slice(i, 1));

  CHECK_THROWS_AS(fsdp::flat_layout(sizes, 2, 256, {true}), fsdp::error);  // one flag for three parameters
}
