// Tests of the element types (core/dtype.hpp): tags, sizes, names, and conversions checked bit
// for bit against hand-computed patterns and against plain integer/double references.

#include "fsdp/core/dtype.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace {

template <class T>
std::uint16_t bits16(T x) {
  static_assert(sizeof(T) == 2);
  std::uint16_t u;
  std::memcpy(&u, &x, 2);
  return u;
}
template <class T>
T from_bits16(std::uint16_t u) {
  T x;
  std::memcpy(static_cast<void*>(&x), &u, 2);
  return x;
}
float float_of_bits(std::uint32_t u) { return std::bit_cast<float>(u); }
std::uint32_t bits_of_float(float f) { return std::bit_cast<std::uint32_t>(f); }

// Reference float -> bf16, round to nearest even, by integer arithmetic on the bits (finite and
// infinite inputs; NaN handled by the caller).
std::uint16_t ref_bf16_bits(std::uint32_t u) {
  const std::uint32_t lsb = (u >> 16) & 1u;
  return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
}

// The value of an f16 bit pattern (finite only), decoded by the IEEE formula.
double f16_value(std::uint16_t b) {
  const int e = (b >> 10) & 0x1f;
  const int m = b & 0x3ff;
  const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -24)
                            : std::ldexp(static_cast<double>(1024 + m), e - 25);
  return (b & 0x8000) ? -mag : mag;
}

// Reference float -> f16: nearest of all positive finite f16 values (ties to an even pattern),
// infinity from 65520 (the midpoint between 65504 and 2^16) up.
std::uint16_t ref_f16_bits(float x) {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (std::uint32_t b = 0; b <= 0x7bff; ++b) t.push_back(f16_value(static_cast<std::uint16_t>(b)));
    return t;
  }();
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 65520.0) return sign | 0x7c00;
  // Largest k with table[k] <= a.
  const auto it = std::upper_bound(table.begin(), table.end(), a);
  const auto k = static_cast<std::uint16_t>((it - table.begin()) - 1);
  if (k == 0x7bff) return sign | k;  // a in [65504, 65520)
  const double lo = a - table[k], hi = table[k + 1u] - a;
  std::uint16_t r = k;
  if (hi < lo || (hi == lo && (k & 1u))) r = static_cast<std::uint16_t>(k + 1u);
  return sign | r;
}

}  // namespace

TEST_CASE("dtype: size_of, to_string and the shardable / reducible sets") {
  using fsdp::dtype;
  struct row {
    dtype t;
    std::size_t size;
    std::string_view name;
    bool shardable, reducible;
  };
  const row rows[] = {
      {dtype::f32, 4, "f32", true, true},   {dtype::bf16, 2, "bf16", true, true},
      {dtype::f16, 2, "f16", true, true},   {dtype::f64, 8, "f64", false, true},
      {dtype::i32, 4, "i32", false, false}, {dtype::i64, 8, "i64", false, false},
      {dtype::u8, 1, "u8", false, false},
  };
  for (const row& r : rows) {
    INFO(r.name);
    CHECK(fsdp::size_of(r.t) == r.size);
    CHECK(fsdp::to_string(r.t) == r.name);
    CHECK(fsdp::is_shardable(r.t) == r.shardable);
    CHECK(fsdp::is_reducible(r.t) == r.reducible);
  }
  // The C++ types have the sizes their tags claim.
  CHECK(sizeof(fsdp::bf16) == fsdp::size_of(dtype::bf16));
  CHECK(sizeof(fsdp::f16) == fsdp::size_of(dtype::f16));
  static_assert(fsdp::size_of(dtype::f64) == 8 && fsdp::to_string(dtype::u8) == "u8");
}

TEST_CASE("dtype: dtype_of maps the C++ element types to their tags") {
  using fsdp::dtype;
  CHECK(fsdp::dtype_of<float> == dtype::f32);
  CHECK(fsdp::dtype_of<double> == dtype::f64);
  CHECK(fsdp::dtype_of<fsdp::bf16> == dtype::bf16);
  CHECK(fsdp::dtype_of<fsdp::f16> == dtype::f16);
  CHECK(fsdp::dtype_of<std::int32_t> == dtype::i32);
  CHECK(fsdp::dtype_of<std::int64_t> == dtype::i64);
  CHECK(fsdp::dtype_of<std::uint8_t> == dtype::u8);
  CHECK(fsdp::dtype_of<const float> == dtype::f32);
  CHECK(fsdp::dtype_of<const fsdp::bf16> == dtype::bf16);

  static_assert(fsdp::element_type<float> && fsdp::element_type<const double>);
  static_assert(!fsdp::element_type<char> && !fsdp::element_type<std::int16_t>);
  static_assert(!fsdp::element_type<float*> && !fsdp::element_type<void>);
  static_assert(fsdp::shardable_type<float> && fsdp::shardable_type<fsdp::bf16> &&
                fsdp::shardable_type<fsdp::f16>);
  static_assert(!fsdp::shardable_type<double> && !fsdp::shardable_type<std::int32_t>);
  CHECK(fsdp::element_type<std::uint8_t>);
  CHECK_FALSE(fsdp::shardable_type<std::int64_t>);
}

TEST_CASE("convert: every bf16 survives bf16 -> float -> bf16, and widening is exact") {
  std::size_t widen_wrong = 0, round_trip_wrong = 0, nan_wrong = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto x = from_bits16<fsdp::bf16>(static_cast<std::uint16_t>(b));
    const float f = fsdp::convert<float>(x);
    const bool nan = ((b >> 7) & 0xff) == 0xff && (b & 0x7f) != 0;
    if (nan) {
      if (!std::isnan(f) || !std::isnan(fsdp::convert<float>(fsdp::convert<fsdp::bf16>(f)))) ++nan_wrong;
      continue;
    }
    if (bits_of_float(f) != (b << 16)) ++widen_wrong;  // bf16 is the top half of a float
    if (bits16(fsdp::convert<fsdp::bf16>(f)) != b) ++round_trip_wrong;
    if (fsdp::convert<double>(x) != static_cast<double>(float_of_bits(b << 16))) ++widen_wrong;
  }
  CHECK(widen_wrong == 0);
  CHECK(round_trip_wrong == 0);
  CHECK(nan_wrong == 0);
}

TEST_CASE("convert: every f16 survives f16 -> float -> f16, and widening is exact") {
  std::size_t widen_wrong = 0, round_trip_wrong = 0, nan_wrong = 0;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto x = from_bits16<fsdp::f16>(static_cast<std::uint16_t>(b));
    const float f = fsdp::convert<float>(x);
    const int e = (b >> 10) & 0x1f;
    if (e == 0x1f) {
      const bool nan = (b & 0x3ff) != 0;
      if (nan != std::isnan(f)) ++nan_wrong;
      if (!nan && (!std::isinf(f) || std::signbit(f) != ((b & 0x8000) != 0))) ++nan_wrong;
      if (!nan && bits16(fsdp::convert<fsdp::f16>(f)) != b) ++round_trip_wrong;
      continue;
    }
    if (static_cast<double>(f) != f16_value(static_cast<std::uint16_t>(b))) ++widen_wrong;
    if (bits16(fsdp::convert<fsdp::f16>(f)) != b) ++round_trip_wrong;
    if (fsdp::convert<double>(x) != f16_value(static_cast<std::uint16_t>(b))) ++widen_wrong;
  }
  CHECK(widen_wrong == 0);
  CHECK(round_trip_wrong == 0);
  CHECK(nan_wrong == 0);
}

TEST_CASE("convert: float -> bf16 rounds to nearest even (hand-checked patterns)") {
  struct row {
    float in;
    std::uint16_t out;
    const char* why;
  };
  const float u = std::ldexp(1.0f, -8);  // half a bf16 ulp at 1.0 (the ulp is 2^-7)
  const row rows[] = {
      {1.0f, 0x3f80, "exact"},
      {1.0f + u, 0x3f80, "1 + 2^-8: tie, 1.0 is even"},
      {1.0f + 3 * u, 0x3f82, "1 + 3*2^-8: tie between 0x3f81 and 0x3f82, take the even one"},
      {1.0f + 2 * u, 0x3f81, "1 + 2^-7: exact"},
      {1.0f + std::ldexp(1.0f, -9), 0x3f80, "1 + 2^-9: below the tie"},
      {1.0f + u + std::ldexp(1.0f, -20), 0x3f81, "1 + 2^-8 + 2^-20: just above the tie"},
      {-(1.0f + u), 0xbf80, "negative tie"},
      {-(1.0f + 3 * u), 0xbf82, "negative tie to even"},
      {float_of_bits(0x3f80ffffu), 0x3f81, "rounds up inside the binade"},
      {float_of_bits(0x3fffffffu), 0x4000, "carry into the exponent: 2.0"},
      {std::numeric_limits<float>::max(), 0x7f80, "FLT_MAX overflows to +inf"},
      {float_of_bits(0x7f7f7fffu), 0x7f7f, "largest value that stays finite"},
      {std::numeric_limits<float>::infinity(), 0x7f80, "+inf"},
      {-std::numeric_limits<float>::infinity(), 0xff80, "-inf"},
      {0.0f, 0x0000, "+0"},
      {-0.0f, 0x8000, "-0"},
      {float_of_bits(0x00008000u), 0x0000, "subnormal tie to even (0)"},
      {float_of_bits(0x00018000u), 0x0002, "subnormal tie to even (2)"},
      {float_of_bits(0x00010001u), 0x0001, "subnormal below the tie"},
      {3.140625f, 0x4049, "pi-ish, exact in bf16"},
  };
  for (const row& r : rows) {
    INFO(r.why);
    CHECK(bits16(fsdp::convert<fsdp::bf16>(r.in)) == r.out);
    CHECK(ref_bf16_bits(bits_of_float(r.in)) == r.out);  // the reference agrees with the hand
  }
  CHECK(std::isnan(fsdp::convert<float>(fsdp::convert<fsdp::bf16>(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("convert: float -> bf16 matches an integer round-to-nearest-even reference") {
  std::mt19937 rng(7);
  std::size_t wrong = 0;
  std::uint32_t first_bad = 0;
  for (int i = 0; i < 400000; ++i) {
    std::uint32_t u = static_cast<std::uint32_t>(rng());
    if (i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties are the interesting cases
    const float f = float_of_bits(u);
    if (std::isnan(f)) continue;
    if (bits16(fsdp::convert<fsdp::bf16>(f)) != ref_bf16_bits(u)) {
      if (wrong++ == 0) first_bad = u;
    }
  }
  INFO("first mismatch at float bits 0x" << std::hex << first_bad);
  CHECK(wrong == 0);
}

TEST_CASE("convert: float -> f16 rounds to nearest even (hand-checked patterns)") {
  struct row {
    float in;
    std::uint16_t out;
    const char* why;
  };
  const auto p2 = [](int e) { return std::ldexp(1.0f, e); };
  const row rows[] = {
      {1.0f, 0x3c00, "exact"},
      {1.0f + p2(-11), 0x3c00, "1 + 2^-11: tie, 1.0 is even"},
      {1.0f + 3 * p2(-11), 0x3c02, "1 + 3*2^-11: tie, take the even 0x3c02"},
      {1.0f + p2(-11) + p2(-20), 0x3c01, "just above the tie"},
      {1.0f + p2(-12), 0x3c00, "below the tie"},
      {-2.5f, 0xc100, "exact negative"},
      {65504.0f, 0x7bff, "largest finite"},
      {65519.0f, 0x7bff, "below the overflow tie"},
      {65520.0f, 0x7c00, "overflow tie goes to +inf (even)"},
      {1.0e6f, 0x7c00, "overflow"},
      {-1.0e6f, 0xfc00, "negative overflow"},
      {p2(-24), 0x0001, "smallest subnormal"},
      {p2(-25), 0x0000, "half the smallest subnormal: tie to 0"},
      {3 * p2(-25), 0x0002, "subnormal tie to even (2)"},
      {p2(-25) + p2(-40), 0x0001, "just above the subnormal tie"},
      {p2(-14), 0x0400, "smallest normal"},
      {p2(-14) - p2(-25), 0x0400, "largest subnormal + half an ulp: tie to the even normal"},
      {-0.0f, 0x8000, "-0"},
  };
  for (const row& r : rows) {
    INFO(r.why);
    CHECK(bits16(fsdp::convert<fsdp::f16>(r.in)) == r.out);
    CHECK(ref_f16_bits(r.in) == r.out);  // the reference agrees with the hand
  }
}

TEST_CASE("convert: float -> f16 matches a nearest-value reference over f16's range") {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> exp(-27, 17);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::size_t wrong = 0;
  float first_bad = 0;
  for (int i = 0; i < 200000; ++i) {
    float f = std::ldexp(mant(rng), exp(rng));
    if (i % 2) f = -f;
    if (i % 3 == 0) {
      // Exact midpoint between two neighbouring f16 values.
      const auto k = static_cast<std::uint16_t>(rng() % 0x7bff);
      f = static_cast<float>((f16_value(k) + f16_value(static_cast<std::uint16_t>(k + 1))) / 2);
    }
    if (bits16(fsdp::convert<fsdp::f16>(f)) != ref_f16_bits(f)) {
      if (wrong++ == 0) first_bad = f;
    }
  }
  INFO("first mismatch at " << first_bad);
  CHECK(wrong == 0);
}

TEST_CASE("convert: wide sources round once, not twice through float") {
  // 1 + 2^-8 + 2^-40 lies just above the bf16 tie at 1 + 2^-8; rounding it to float first loses
  // the 2^-40 and makes an exact tie, which would round down to 1.0.
  const double above_bf16_tie = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  CHECK(bits16(fsdp::convert<fsdp::bf16>(above_bf16_tie)) == 0x3f81);
  CHECK(bits16(fsdp::convert<fsdp::bf16>(-above_bf16_tie)) == 0xbf81);
  const double above_f16_tie = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  CHECK(bits16(fsdp::convert<fsdp::f16>(above_f16_tie)) == 0x3c01);
  // Plain doubles that are exact in the narrow type stay exact.
  CHECK(bits16(fsdp::convert<fsdp::bf16>(1.0 + 3 * std::ldexp(1.0, -8))) == 0x3f82);
  CHECK(bits16(fsdp::convert<fsdp::bf16>(0.5)) == 0x3f00);
  CHECK(bits16(fsdp::convert<fsdp::f16>(-0.25)) == 0xb400);
  // An int above 2^24: 2^24 + 2^16 + 1 is just above the bf16 tie between 2^24 and 2^24 + 2^17.
  const std::int32_t big = (1 << 24) + (1 << 16) + 1;
  CHECK(static_cast<double>(fsdp::convert<float>(fsdp::convert<fsdp::bf16>(big))) ==
        static_cast<double>((1 << 24) + (1 << 17)));
}

TEST_CASE("convert: between the narrow types, and plain casts elsewhere") {
  // f16 1 + 3*2^-8 is exact in f16; in bf16 it is a tie between 0x3f81 and 0x3f82 -> 0x3f82.
  const auto h = from_bits16<fsdp::f16>(0x3c0c);  // 1 + 12*2^-10 = 1 + 3*2^-8
  REQUIRE(f16_value(0x3c0c) == 1.0 + 3.0 / 256.0);
  CHECK(bits16(fsdp::convert<fsdp::bf16>(h)) == 0x3f82);
  // bf16 1 + 2^-7 is exact in f16.
  CHECK(bits16(fsdp::convert<fsdp::f16>(from_bits16<fsdp::bf16>(0x3f81))) == 0x3c08);
  // Identity keeps the bits.
  CHECK(bits16(fsdp::convert<fsdp::bf16>(from_bits16<fsdp::bf16>(0x1234))) == 0x1234);
  CHECK(fsdp::convert<float>(2.5) == 2.5f);
  CHECK(fsdp::convert<double>(0.1f) == static_cast<double>(0.1f));
  CHECK(fsdp::convert<float>(std::int32_t{-7}) == -7.0f);
  CHECK(fsdp::convert<double>(from_bits16<fsdp::bf16>(0xc040)) == -3.0);
  CHECK(fsdp::convert<std::int32_t>(from_bits16<fsdp::f16>(0x4500)) == 5);  // 5.0 in f16
}

TEST_CASE("visit_floating calls f with the C++ type of floating dtypes only") {
  using fsdp::dtype;
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16, dtype::f64}) {
    INFO(fsdp::to_string(t));
    int calls = 0;
    dtype seen = dtype::u8;
    std::size_t size = 0;
    const bool ok = fsdp::visit_floating(t, [&](auto x) {
      ++calls;
      seen = fsdp::dtype_of<decltype(x)>;
      size = sizeof(x);
    });
    CHECK(ok);
    CHECK(calls == 1);
    CHECK(seen == t);
    CHECK(size == fsdp::size_of(t));
  }
  for (dtype t : {dtype::i32, dtype::i64, dtype::u8}) {
    INFO(fsdp::to_string(t));
    int calls = 0;
    CHECK_FALSE(fsdp::visit_floating(t, [&](auto) { ++calls; }));
    CHECK(calls == 0);
  }
}
