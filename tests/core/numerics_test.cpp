// The per-element formats of metrale/numerics.h against independent float64 references
// (core/numerics_reference.h): the BF16 → E4M3 cast exhaustively over all 65,536 BF16 bit
// patterns, every E4M3, E2M1 and E8M0 code decoded, FP32 → BF16 rounding, FP32 → E2M1 at every
// midpoint, and the nibble order of packed codes.
#include "metrale/numerics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/numerics_reference.h"

namespace metrale {
namespace {

namespace ref = testing::ref;

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Bitwise equality of a float and a double (through the double's value and sign).
bool same_value(float got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  return static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
}

// ---- E4M3 ----

TEST(E4m3Reference, TableHas254FiniteValuesAndTheRightLandmarks) {
  // The reference itself: 254 finite codes (127 magnitudes × 2 signs), strictly increasing.
  int finite = 0;
  for (int c = 0; c < 256; ++c)
    finite += std::isnan(ref::e4m3_value(static_cast<std::uint8_t>(c))) ? 0 : 1;
  EXPECT_EQ(finite, 254);
  const auto& mags = ref::e4m3_magnitudes();
  for (std::size_t i = 1; i < mags.size(); ++i) EXPECT_LT(mags[i - 1], mags[i]) << i;
  EXPECT_EQ(mags[0x01], std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_EQ(mags[0x07], 7 * std::ldexp(1.0, -9));
  EXPECT_EQ(mags[0x08], std::ldexp(1.0, -6));  // smallest normal
  EXPECT_EQ(mags[0x38], 1.0);
  EXPECT_EQ(mags[0x7E], 448.0);
  EXPECT_EQ(ref::nearest_e4m3(1.0 + 1.0 / 16), 0x38);  // tie between 1 (even) and 1.125
  EXPECT_EQ(ref::nearest_e4m3(1.0 + 3.0 / 16), 0x3A);  // tie between 1.125 and 1.25 (even)
}

TEST(E4m3Decode, AllCodesMatchTheFormula) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float got = num::e4m3_to_f32(code);
    const double want = ref::e4m3_value(code);
    EXPECT_TRUE(same_value(got, want)) << "code 0x" << std::hex << c << ": " << got;
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << std::hex << c;
    }
  }
  EXPECT_EQ(num::e4m3_to_f32(0x7E), num::kE4m3Max);
  EXPECT_EQ(num::e4m3_to_f32(0xFE), -num::kE4m3Max);
}

TEST(E4m3Cast, ExhaustiveOverAllBf16BitPatterns) {
  int mismatches = 0;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const double x = ref::bf16_value(b);
    const std::uint8_t want = ref::nearest_e4m3(x);
    const std::uint8_t got = num::bf16_to_e4m3(b);
    if (got != want && ++mismatches <= 20) {
      ADD_FAILURE() << "bf16 0x" << std::hex << h << " (" << x << "): got 0x" << int{got}
                    << ", want 0x" << int{want};
    }
    // Whatever the code, it decodes to a value of x's sign: -0 stays -0, negatives stay negative.
    if (!std::isnan(x)) {
      EXPECT_EQ((got & 0x80) != 0, std::signbit(x)) << std::hex << h;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(E4m3Cast, SaturatesRoundsAndKeepsNan) {
  EXPECT_EQ(num::f32_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(num::f32_to_e4m3(463.9f), 0x7E);
  EXPECT_EQ(num::f32_to_e4m3(464.0f), 0x7E);  // the would-be tie with 480 saturates
  EXPECT_EQ(num::f32_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(num::f32_to_e4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(num::f32_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(num::f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(num::f32_to_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(num::f32_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(num::f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(num::f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // half the smallest: tie to 0
  EXPECT_EQ(num::f32_to_e4m3(std::ldexp(3.0f, -10)), 0x02);   // 1.5 × 2^-9: tie to 2
  EXPECT_EQ(num::f32_to_e4m3(std::ldexp(15.0f, -10)), 0x08);  // 7.5 × 2^-9: to 2^-6
  EXPECT_EQ(num::f32_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(num::f32_to_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
}

TEST(E4m3Cast, RandomFloatsMatchTheReference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mag(-20.0f, 10.0f);
  int mismatches = 0;
  for (int i = 0; i < 200000; ++i) {
    // Log-uniform magnitudes over E4M3's range and beyond, both signs, plus raw bit patterns.
    float f = std::exp2(mag(gen)) * (gen() & 1 ? -1.0f : 1.0f);
    if (i % 4 == 0) f = from_bits(static_cast<std::uint32_t>(gen()));
    const std::uint8_t want = ref::nearest_e4m3(static_cast<double>(f));
    const std::uint8_t got = num::f32_to_e4m3(f);
    if (got != want && ++mismatches <= 20) {
      ADD_FAILURE() << "f32 0x" << std::hex << bits(f) << ": got 0x" << int{got} << ", want 0x"
                    << int{want};
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---- BF16 ----

// The nearest BF16 of a non-NaN float in float64: the two BF16 neighbours of f (its truncation
// and the next pattern away from zero), ties to the even pattern, and past the largest finite
// BF16 the rounding treats infinity as the would-be 2^128.
std::uint16_t reference_bf16(float f) {
  const std::uint32_t u = bits(f);
  const auto lo = static_cast<std::uint16_t>(u >> 16);
  const double x = std::fabs(static_cast<double>(f));
  const double lo_v = std::fabs(ref::bf16_value(lo));
  if (lo_v == x) return lo;
  const auto hi = static_cast<std::uint16_t>(lo + 1);
  const double hi_v =
      (hi & 0x7FFF) == 0x7F80 ? std::ldexp(1.0, 128) : std::fabs(ref::bf16_value(hi));
  const double dlo = x - lo_v, dhi = hi_v - x;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Bf16Decode, AllPatternsExact) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const float got = num::bf16_to_f32(b);
    EXPECT_TRUE(same_value(got, ref::bf16_value(b))) << std::hex << h;
    EXPECT_EQ(bits(got), h << 16) << std::hex << h;  // exact: the pattern is the float's top half
    if (std::isnan(got)) {
      EXPECT_EQ(std::signbit(got), (h & 0x8000u) != 0) << std::hex << h;
    }
  }
}

TEST(Bf16Round, ChosenCases) {
  struct Case {
    std::uint32_t f32;
    std::uint16_t bf16;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80},  // 1
      {0x3F808000u, 0x3F80},  // 1 + 2^-8: tie, 0x3F80 is even → down
      {0x3F818000u, 0x3F82},  // 1 + 3·2^-8: tie, 0x3F81 is odd → up
      {0x3F808001u, 0x3F81},  // just above the tie → up
      {0x3F807FFFu, 0x3F80},  // just below the tie → down
      {0xBF818000u, 0xBF82},  // negative tie, rounds away from zero to the even pattern
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX rounds to +inf (past the largest BF16 + half ulp)
      {0x7F7F7FFFu, 0x7F7F},  // largest value that stays finite
      {0x7F7F8000u, 0x7F80},  // tie at the top: 0x7F7F is odd → inf
      {0x7F800000u, 0x7F80},  // +inf
      {0xFF800000u, 0xFF80},  // -inf
      {0x00000000u, 0x0000},  // +0
      {0x80000000u, 0x8000},  // -0
      {0x00008000u, 0x0000},  // subnormal tie to even 0
      {0x00018000u, 0x0002},  // subnormal tie up to even 2
      {0x00000001u, 0x0000},  // denorm_min → 0
      {0x007FFFFFu, 0x0080},  // largest subnormal rounds up to the smallest normal
  };
  for (const Case& c : cases) {
    EXPECT_EQ(num::f32_to_bf16(from_bits(c.f32)), c.bf16) << std::hex << c.f32;
    EXPECT_EQ(reference_bf16(from_bits(c.f32)), c.bf16) << "reference, " << std::hex << c.f32;
  }
}

TEST(Bf16Round, NanStaysNanWithItsSign) {
  const std::uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u,
                                0x7FFFFFFFu, 0x7F80FFFFu, 0x7F810000u};
  for (const std::uint32_t u : nans) {
    const std::uint16_t h = num::f32_to_bf16(from_bits(u));
    EXPECT_TRUE(std::isnan(num::bf16_to_f32(h))) << std::hex << u << " → " << h;
    EXPECT_EQ((h & 0x8000u) != 0, (u & 0x80000000u) != 0) << std::hex << u;
    EXPECT_NE(h & 0x0040u, 0) << "quiet bit, " << std::hex << u;
  }
}

TEST(Bf16Round, RandomFloatsMatchTheFloat64Reference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int mismatches = 0;
  for (int i = 0; i < 1000000; ++i) {
    // Raw bit patterns (every exponent, subnormals), ordinary values, and exact ties.
    std::uint32_t u = static_cast<std::uint32_t>(gen());
    if (i % 3 == 1) u = bits(normal(gen));
    if (i % 3 == 2) u = (u & 0xFFFF0000u) | 0x8000u;
    const float f = from_bits(u);
    if (std::isnan(f)) continue;
    const std::uint16_t want = reference_bf16(f);
    const std::uint16_t got = num::f32_to_bf16(f);
    if (got != want && ++mismatches <= 20) {
      ADD_FAILURE() << "f32 0x" << std::hex << u << ": got 0x" << got << ", want 0x" << want;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---- E2M1 ----

TEST(E2m1Decode, AllSixteenCodes) {
  const float want[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    EXPECT_EQ(bits(num::e2m1_to_f32(code)), bits(want[c])) << c;
    EXPECT_TRUE(same_value(num::e2m1_to_f32(code), ref::e2m1_value(code))) << c;
  }
  EXPECT_EQ(num::e2m1_to_f32(0x17), 6.0f);  // only the low 4 bits count
}

TEST(E2m1Round, MidpointsTieToTheEvenCode) {
  struct Case {
    float x;
    std::uint8_t code;
  };
  // Midpoints between neighbours; the even code (even mantissa bit) wins each tie.
  const Case ties[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4},
                       {2.5f, 4},  {3.5f, 6},  {5.0f, 6}};
  for (const Case& c : ties) {
    EXPECT_EQ(num::f32_to_e2m1(c.x), c.code) << c.x;
    EXPECT_EQ(num::f32_to_e2m1(-c.x), c.code | 8) << -c.x;
    EXPECT_EQ(ref::nearest_e2m1(static_cast<double>(c.x)), c.code) << "reference, " << c.x;
    // Either side of the midpoint goes to the nearer neighbour.
    const float below = std::nextafter(c.x, 0.0f), above = std::nextafter(c.x, 10.0f);
    EXPECT_EQ(num::f32_to_e2m1(below), ref::nearest_e2m1(static_cast<double>(below))) << below;
    EXPECT_EQ(num::f32_to_e2m1(above), ref::nearest_e2m1(static_cast<double>(above))) << above;
    EXPECT_EQ(num::f32_to_e2m1(above) - num::f32_to_e2m1(below), 1) << c.x;
  }
}

TEST(E2m1Round, ExactValuesSaturationSignAndNan) {
  for (int c = 0; c < 16; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    EXPECT_EQ(num::f32_to_e2m1(num::e2m1_to_f32(code)), code) << c;  // -0 → 0x8 too
  }
  EXPECT_EQ(num::f32_to_e2m1(6.5f), 7);
  EXPECT_EQ(num::f32_to_e2m1(1e30f), 7);
  EXPECT_EQ(num::f32_to_e2m1(-7.0f), 15);
  EXPECT_EQ(num::f32_to_e2m1(std::numeric_limits<float>::infinity()), 7);
  EXPECT_EQ(num::f32_to_e2m1(-std::numeric_limits<float>::infinity()), 15);
  EXPECT_EQ(num::f32_to_e2m1(0.1f), 0);
  EXPECT_EQ(num::f32_to_e2m1(-0.1f), 8);
  EXPECT_EQ(num::f32_to_e2m1(std::numeric_limits<float>::quiet_NaN()), 0);
  EXPECT_EQ(num::f32_to_e2m1(-std::numeric_limits<float>::quiet_NaN()), 0);
}

TEST(E2m1Round, RandomFloatsMatchTheReference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> uni(-8.0f, 8.0f);
  for (int i = 0; i < 100000; ++i) {
    const float f = uni(gen);
    ASSERT_EQ(num::f32_to_e2m1(f), ref::nearest_e2m1(static_cast<double>(f))) << f;
  }
  // Every quarter step from -8 to 8 hits each value, each midpoint and the saturation region.
  for (int q = -32; q <= 32; ++q) {
    const float f = static_cast<float>(q) * 0.25f;
    EXPECT_EQ(num::f32_to_e2m1(f), ref::nearest_e2m1(static_cast<double>(f))) << f;
  }
}

// ---- E8M0 ----

TEST(E8m0Decode, AllCodesArePowersOfTwo) {
  for (int e = 0; e < 255; ++e) {
    const auto code = static_cast<std::uint8_t>(e);
    EXPECT_EQ(static_cast<double>(num::e8m0_to_f32(code)), std::ldexp(1.0, e - 127)) << e;
    EXPECT_EQ(static_cast<double>(num::e8m0_to_f32(code)), ref::e8m0_value(code)) << e;
  }
  EXPECT_TRUE(std::isnan(num::e8m0_to_f32(0xFF)));
  EXPECT_EQ(num::e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(num::e8m0_to_f32(0), std::ldexp(1.0f, -127));  // a float subnormal
  EXPECT_EQ(num::e8m0_to_f32(254), std::ldexp(1.0f, 127));
}

// ---- packed codes ----

TEST(NumericsPackedCode, LowNibbleIsTheEvenK) {
  const std::vector<std::uint8_t> row = {0x21, 0x43, 0x65, 0x87, 0xA9, 0xCB, 0xED, 0x0F};
  for (std::int64_t k = 0; k < 16; ++k) {
    EXPECT_EQ(num::packed_code(row.data(), k), (k + 1) & 0xF) << k;
  }
  const std::uint8_t byte = 0x7A;
  EXPECT_EQ(num::packed_code(&byte, 0), 0xA);
  EXPECT_EQ(num::packed_code(&byte, 1), 0x7);
}

TEST(NumericsConstants, GroupsAndMax) {
  EXPECT_EQ(num::kNvfp4Group, 16);
  EXPECT_EQ(num::kMxfp4Group, 32);
  EXPECT_EQ(num::kE4m3Max, 448.0f);
}

// ---- the GPU kernels' packed conversions (numerics.h), on the host ----

TEST(BytePerm, SelectsBytesOfTheEightAsCudaDocuments) {
  const std::uint32_t x = 0x03020100u, y = 0x07060504u;
  EXPECT_EQ(num::byte_perm(x, y, 0x3210u), x);
  EXPECT_EQ(num::byte_perm(x, y, 0x7654u), y);
  EXPECT_EQ(num::byte_perm(x, y, 0x5140u), 0x05010400u);
  EXPECT_EQ(num::byte_perm(x, y, 0x0000u), 0x00000000u);
  EXPECT_EQ(num::byte_perm(x, y, 0x7777u), 0x07070707u);
  // Only the low 3 bits of a selector nibble choose (the kernels mask the 4th to 0).
  EXPECT_EQ(num::byte_perm(x, y, 0x0123u), 0x00010203u);
}

TEST(E2m1x4ToBf16, EveryFourCodeWordGivesTheFourExactValues) {
  for (std::uint32_t w = 0; w < 0x10000u; ++w) {
    std::uint32_t p01 = 0, p23 = 0;
    num::e2m1x4_to_bf16(w, &p01, &p23);
    const std::uint32_t got[4] = {p01 & 0xFFFFu, p01 >> 16, p23 & 0xFFFFu, p23 >> 16};
    for (int i = 0; i < 4; ++i) {
      const auto code = static_cast<std::uint8_t>((w >> (4 * i)) & 0xFu);
      const std::uint16_t want = num::f32_to_bf16(num::e2m1_to_f32(code));
      ASSERT_EQ(got[i], want) << "word 0x" << std::hex << w << " element " << i;
    }
  }
}

TEST(Bf16x2Mul, ScaledCodesAreExactForEveryScaleCode) {
  // What the kernels do: (E2M1 pair) x (scale pair), against the float product.
  for (std::uint32_t w = 0; w < 0x100u; ++w) {
    std::uint32_t p01 = 0, p23 = 0;
    num::e2m1x4_to_bf16(w, &p01, &p23);
    for (int s = 0; s < 256; ++s) {
      for (const bool mx : {false, true}) {
        const float scale = mx ? num::e8m0_to_f32(static_cast<std::uint8_t>(s))
                               : num::e4m3_to_f32(static_cast<std::uint8_t>(s));
        if (scale != scale) continue;  // NaN scales: NaN in, NaN out, checked below
        const std::uint32_t r = num::bf16x2_mul(p01, num::bf16_pair_of(scale));
        for (int i = 0; i < 2; ++i) {
          const float want =
              num::e2m1_to_f32(static_cast<std::uint8_t>((w >> (4 * i)) & 0xFu)) * scale;
          ASSERT_EQ(num::bf16_to_f32(static_cast<std::uint16_t>(r >> (16 * i))), want)
              << "codes 0x" << std::hex << w << " scale code " << s << (mx ? " e8m0" : " e4m3");
        }
      }
    }
  }
  const std::uint32_t nan = num::bf16x2_mul(0x3F803F80u, num::bf16_pair_of(num::e4m3_to_f32(0x7F)));
  EXPECT_NE(num::bf16_to_f32(static_cast<std::uint16_t>(nan)),
            num::bf16_to_f32(static_cast<std::uint16_t>(nan)));
}

}  // namespace
}  // namespace metrale
