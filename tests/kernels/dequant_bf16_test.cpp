// The dequant route's value rule (kernels/dequant_bf16.h) on the host: bf16_of_product rounds the
// exact product once, including the products whose FP32 rounding lands on a BF16 midpoint (where
// rounding twice goes the wrong way), and table_of (two roundings per block scale and powers of
// two for the rest, or each magnitude rounded on its own) gives the exact value rounded once.
#include "kernels/dequant_bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "metrale/numerics.h"

namespace metrale {
namespace {

// v (exact in double) rounded once to BF16, nearest even, over BF16's whole range: subnormals
// at 2^-133 steps, and past the largest finite value infinity.
std::uint16_t exact_bf16(double v) {
  const std::uint16_t sign = std::signbit(v) ? 0x8000 : 0x0000;
  if (v == 0.0) return sign;
  double r = 0.0;
  if (std::fabs(v) < std::ldexp(1.0, -126)) {
    r = std::ldexp(std::nearbyint(std::ldexp(v, 133)), -133);
  } else {
    int e = 0;
    const double frac = std::frexp(v, &e);
    r = std::ldexp(std::nearbyint(std::ldexp(frac, 8)), e - 8);
  }
  if (std::fabs(r) >= std::ldexp(1.0, 128)) return sign | 0x7F80;
  return static_cast<std::uint16_t>(num::f32_bits(static_cast<float>(r)) >> 16);
}

TEST(DequantBf16Value, RoundsTheExactProductOnce) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-20, 20), sign(0, 1);
  int twice_differs = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    const float x = std::ldexp(mant(rng), ex(rng)) * (sign(rng) ? -1.0f : 1.0f);
    const float ts = std::ldexp(mant(rng), ex(rng));
    const std::uint16_t want = exact_bf16(double{x} * double{ts});
    twice_differs += num::f32_to_bf16(x * ts) != want;
    ASSERT_EQ(dequant::bf16_of_product(x, ts), want) << x << " x " << ts;
  }
  // The rule matters: rounding to FP32 first and then to BF16 gets some of these wrong.
  EXPECT_GT(twice_differs, 0);
}

// Every E4M3 and E8M0 scale code (NaN aside) with tensor scales of any significand over 2^±60:
// each of the 16 codes' values from the table is the exact e2m1 × scale × ts rounded once, also
// where the product is subnormal or overflows. The one exception is documented in the header:
// off the shortcut, e2m1 × scale itself must fit FP32 (an E8M0 scale of 2^127 times |e2m1| ≥ 2
// is inf there).
TEST(DequantBf16Value, TableIsTheExactValueRoundedOnce) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-60, 60);
  int checked = 0;
  for (int i = 0; i < 200'000; ++i) {
    const auto code = static_cast<std::uint8_t>(i % 256);
    const float scale = i % 2 ? num::e4m3_to_f32(code) : num::e8m0_to_f32(code);
    if (std::isnan(scale)) continue;
    const float ts = std::ldexp(mant(rng), ex(rng));
    const dequant::Table t = dequant::table_of(scale, ts);
    const std::uint32_t one = dequant::bf16_of_product(scale, ts), e = (one >> 7) & 0xFF;
    const bool shortcut = e >= 3 && e <= 251;
    for (std::uint32_t c = 0; c < 16; ++c) {
      const double e2m1 = num::e2m1_to_f32(static_cast<std::uint8_t>(c));
      if (!shortcut && !std::isfinite(static_cast<float>(e2m1 * scale))) continue;
      std::uint32_t p01 = 0, p23 = 0;
      dequant::scaled_x4(t, c | c << 4 | c << 8 | c << 12, &p01, &p23);
      const std::uint16_t want = exact_bf16(e2m1 * double{scale} * double{ts});
      for (const std::uint32_t got : {p01 & 0xFFFFu, p01 >> 16, p23 & 0xFFFFu, p23 >> 16}) {
        ASSERT_EQ(got, want) << "code " << c << " scale " << scale << " ts " << ts;
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 1'000'000);
}

}  // namespace
}  // namespace metrale
