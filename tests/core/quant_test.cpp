// The host quantizers of metrale/quant.h: NVFP4 and MXFP4 scale rules, codes checked against the
// float64 references of core/numerics_reference.h, exact per-element error bounds and the
// normalized error on fresh random data (normal and heavy-tailed), idempotence on representable
// values, zero blocks, saturation, both layouts, and argument errors.
//
// The per-element bound. With S the element's full scale (decoded block scale × tensor scale,
// an exact product in double) and x = |w| / S, the code is the nearest E2M1 of x, so
//   |w − c·S| ≤ S · g(x),  g(x) = half the E2M1 spacing around x for x ≤ 6 (0.25 up to 2,
//                                 0.5 up to 4, 1 up to 6), and x − 6 past 6 (saturation);
// the dequantized float adds at most its own rounding, 2^-24 · |c·S| (plus 2^-150 should it be
// a float subnormal). When S is 0 (a zero block, or a block scale that rounds to E4M3 zero) every
// code is 0 and the error is |w| itself. How far past 6 x can go depends on the format:
//  - NVFP4: the block scale s is the nearest E4M3 of v = amax / (6·T). For a normal E4M3 s,
//    v/s ≤ 8.5/8 (half a step up at a binade bottom) and v/s ≥ 7.5/8 (at 2^-6, whose lower
//    neighbour is 7·2^-9; 8.5/9 or more elsewhere), so the block's largest x = 6·v/s lies in
//    [5.625, 6.375]: it always gets code ±6, and saturation costs at most 0.375·S < 1·S, so the
//    plain half-spacing bound holds for every element. A subnormal s (block amax below ~3.5e-5
//    of the tensor absmax) is coarser, x can reach 9, and only the saturation branch of g
//    covers it.
//  - MXFP4: S = 2^(floor(log2 amax) − 2) puts the block's largest x in [4, 8), so saturation
//    costs up to 2·S and g(x) < 2.
#include "metrale/quant.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "core/numerics_reference.h"
#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale {
namespace {

namespace ref = testing::ref;
using ::testing::HasSubstr;
using ::testing::StartsWith;

struct Shape {
  std::int64_t n, k;
};

// NVFP4 shapes (k a multiple of 16) and MXFP4 shapes (k a multiple of 32), several of them not
// powers of two.
const Shape kNvfp4Shapes[] = {{1, 16}, {3, 48}, {37, 272}, {5, 160}, {64, 512}};
const Shape kMxfp4Shapes[] = {{1, 32}, {3, 96}, {37, 288}, {5, 160}, {64, 512}};

enum class Dist { kGaussian, kStudentT3, kCauchy, kOutliers };
const Dist kAllDists[] = {Dist::kGaussian, Dist::kStudentT3, Dist::kCauchy, Dist::kOutliers};

const char* name(Dist d) {
  switch (d) {
    case Dist::kGaussian:
      return "gaussian";
    case Dist::kStudentT3:
      return "student-t3";
    case Dist::kCauchy:
      return "cauchy";
    case Dist::kOutliers:
      return "gaussian+1% x50 outliers";
  }
  return "?";
}

// Fresh weights of a typical LLM scale: N(0, 0.02²), Student's t with 3 degrees of freedom
// (× 0.02), Cauchy (0.01), or N(0, 0.02²) with 1% of the elements 50× larger.
std::vector<float> random_weights(std::mt19937_64& gen, Dist dist, std::int64_t count) {
  std::vector<float> w(static_cast<std::size_t>(count));
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::student_t_distribution<float> student(3.0f);
  std::cauchy_distribution<float> cauchy(0.0f, 0.01f);
  std::bernoulli_distribution outlier(0.01);
  for (float& x : w) {
    switch (dist) {
      case Dist::kGaussian:
        x = normal(gen);
        break;
      case Dist::kStudentT3:
        x = 0.02f * student(gen);
        break;
      case Dist::kCauchy:
        x = cauchy(gen);
        break;
      case Dist::kOutliers:
        x = normal(gen) * (outlier(gen) ? 50.0f : 1.0f);
        break;
    }
  }
  return w;
}

unsigned fresh_seed() {
  return std::random_device{}();
}

float absmax(const std::vector<float>& w, std::size_t begin, std::size_t count) {
  float m = 0.0f;
  for (std::size_t i = begin; i < begin + count; ++i) m = std::max(m, std::fabs(w[i]));
  return m;
}

// The stored form of the nearest E2M1 of x: the quantizers keep one zero, +0 (code 0).
std::uint8_t canonical_e2m1(double x) {
  const std::uint8_t c = ref::nearest_e2m1(x);
  return c == 0x8 ? std::uint8_t{0} : c;
}

// floor(log2(a)) for a finite a > 0, by comparing with powers of two (no ilogb/frexp).
int floor_log2(double a) {
  int e = 0;
  while (std::ldexp(1.0, e) > a) --e;
  while (std::ldexp(1.0, e + 1) <= a) ++e;
  return e;
}

// g(x) of the header comment: the E2M1 rounding error bound in units of the scale.
double grid_error_bound(double x) {
  return x <= 6.0 ? ref::e2m1_half_spacing(x) : x - 6.0;
}

struct ErrorSums {
  double err2 = 0, norm2 = 0;
  std::int64_t elements = 0;
  double max_x = 0;  // largest |w| / S seen (saturation reach)
};

// Checks every element of q against the definition for weights w: codes are the nearest E2M1
// of w / S, the dequantized value is c·S rounded once, and |w − deq| obeys the exact bound.
// The block scale itself is checked by the callers (the rule differs per format).
void check_elements(const std::vector<float>& w, const HostQuantWeights& q, ErrorSums& sums) {
  const std::vector<float> deq = dequantize(q);
  ASSERT_EQ(deq.size(), w.size());
  const int group = group_size(q.format);
  for (std::int64_t r = 0; r < q.n; ++r) {
    for (std::int64_t c = 0; c < q.k; ++c) {
      const auto i = static_cast<std::size_t>(r * q.k + c);
      const std::uint8_t s = q.scales[static_cast<std::size_t>(r * (q.k / group) + c / group)];
      const double block =
          q.format == WeightFormat::kNvfp4 ? ref::e4m3_value(s) : ref::e8m0_value(s);
      const double S = block * static_cast<double>(q.tensor_scale);  // exact
      const double wi = static_cast<double>(w[i]);
      const std::uint8_t want = S > 0 ? canonical_e2m1(wi / S) : std::uint8_t{0};
      const std::uint8_t code = q.code(r, c);
      ASSERT_EQ(code, want) << "w[" << r << ", " << c << "] = " << w[i] << ", S = " << S;
      const double exact = ref::e2m1_value(code) * S;
      ASSERT_EQ(deq[i], static_cast<float>(exact)) << "w[" << r << ", " << c << "]";
      ASSERT_EQ(q.weight(r, c), deq[i]);
      ASSERT_TRUE(std::isfinite(deq[i]));
      const double err = std::fabs(wi - static_cast<double>(deq[i]));
      if (S > 0) {
        const double x = std::fabs(wi) / S;
        const double bound = S * grid_error_bound(x) + 0x1p-24 * std::fabs(exact) + 0x1p-150;
        // 1e-12: slack for the double arithmetic of the check itself (x and S·(x − 6) round).
        ASSERT_LE(err, bound * (1 + 1e-12)) << "w[" << r << ", " << c << "] = " << w[i] << ", deq "
                                            << deq[i] << ", S = " << S << ", x = " << x;
        sums.max_x = std::max(sums.max_x, x);
      } else {
        ASSERT_EQ(deq[i], 0.0f);
        ASSERT_EQ(err, std::fabs(wi));
      }
      sums.err2 += err * err;
      sums.norm2 += wi * wi;
      ++sums.elements;
    }
  }
}

// Checks an NVFP4 quantization of w[n, k] against the spec: tensor scale, block scales, codes,
// dequantized values and error bounds.
void check_nvfp4(const std::vector<float>& w, const Shape& sh, const HostQuantWeights& q,
                 ErrorSums& sums) {
  ASSERT_EQ(q.format, WeightFormat::kNvfp4);
  ASSERT_EQ(q.layout, WeightLayout::kRowMajor);
  ASSERT_EQ(q.n, sh.n);
  ASSERT_EQ(q.k, sh.k);
  ASSERT_EQ(q.codes.size(), static_cast<std::size_t>(sh.n * sh.k / 2));
  ASSERT_EQ(q.scales.size(), static_cast<std::size_t>(sh.n * sh.k / 16));
  const float amax = absmax(w, 0, w.size());
  // Tensor scale = absmax / (6 × 448), one correctly rounded division (1 for all zeros).
  if (amax > 0) {
    ASSERT_EQ(q.tensor_scale, amax / 2688.0f);
    ASSERT_EQ(q.tensor_scale, static_cast<float>(static_cast<double>(amax) / (6.0 * 448.0)));
  } else {
    ASSERT_EQ(q.tensor_scale, 1.0f);
  }
  const double T = static_cast<double>(q.tensor_scale);
  const bool normal_tensor_scale = q.tensor_scale >= FLT_MIN;
  for (std::int64_t r = 0; r < sh.n; ++r) {
    for (std::int64_t b = 0; b < sh.k / 16; ++b) {
      const float bamax = absmax(w, static_cast<std::size_t>(r * sh.k + b * 16), 16);
      const std::uint8_t s = q.scales[static_cast<std::size_t>(r * (sh.k / 16) + b)];
      // The nearest E4M3 of block absmax / 6 / tensor scale (0 for a zero block).
      const std::uint8_t want = bamax > 0 ? ref::nearest_e4m3(bamax / (6.0 * T)) : 0;
      ASSERT_EQ(s, want) << "block (" << r << ", " << b << "), amax " << bamax;
      ASSERT_EQ(s & 0x80, 0);
      if (s >= 0x08 && normal_tensor_scale) {
        // A normal E4M3 scale: the block's largest element has x in [5.625, 6.375], code ±6.
        const double S = ref::e4m3_value(s) * T;
        EXPECT_LE(bamax / S, 6.375) << "block (" << r << ", " << b << ")";
        EXPECT_GE(bamax / S, 5.625) << "block (" << r << ", " << b << ")";
        std::uint8_t top = 0;
        for (int j = 0; j < 16; ++j) top = std::max<std::uint8_t>(top, q.code(r, b * 16 + j) & 7);
        EXPECT_EQ(top, 7) << "block (" << r << ", " << b << ")";
      }
    }
  }
  check_elements(w, q, sums);
}

// Checks an MXFP4 quantization: E8M0 scale 2^(floor(log2 amax) − 2) (clamped to the E8M0 range;
// byte 0 for a zero block), codes, dequantized values and error bounds.
void check_mxfp4(const std::vector<float>& w, const Shape& sh, const HostQuantWeights& q,
                 ErrorSums& sums) {
  ASSERT_EQ(q.format, WeightFormat::kMxfp4);
  ASSERT_EQ(q.layout, WeightLayout::kRowMajor);
  ASSERT_EQ(q.n, sh.n);
  ASSERT_EQ(q.k, sh.k);
  ASSERT_EQ(q.codes.size(), static_cast<std::size_t>(sh.n * sh.k / 2));
  ASSERT_EQ(q.scales.size(), static_cast<std::size_t>(sh.n * sh.k / 32));
  ASSERT_EQ(q.tensor_scale, 1.0f);
  for (std::int64_t r = 0; r < sh.n; ++r) {
    for (std::int64_t b = 0; b < sh.k / 32; ++b) {
      const float bamax = absmax(w, static_cast<std::size_t>(r * sh.k + b * 32), 32);
      const std::uint8_t s = q.scales[static_cast<std::size_t>(r * (sh.k / 32) + b)];
      const int want =
          bamax > 0 ? std::clamp(floor_log2(static_cast<double>(bamax)) - 2 + 127, 0, 254) : 0;
      ASSERT_EQ(int{s}, want) << "block (" << r << ", " << b << "), amax " << bamax;
      if (bamax > 0 && want > 0) {
        const double x = static_cast<double>(bamax) / ref::e8m0_value(s);
        EXPECT_GE(x, 4.0);
        EXPECT_LT(x, 8.0);
      }
    }
  }
  check_elements(w, q, sums);
}

// ---- NVFP4 ----

TEST(QuantNvfp4, TensorScaleIsAbsmaxOver2688) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  for (const Shape& sh : kNvfp4Shapes) {
    const std::vector<float> w = random_weights(gen, Dist::kGaussian, sh.n * sh.k);
    const HostQuantWeights q = quantize_nvfp4(w, sh.n, sh.k);
    const float amax = absmax(w, 0, w.size());
    EXPECT_EQ(q.tensor_scale, amax / (6.0f * 448.0f)) << sh.n << "x" << sh.k;
  }
  // Hand-picked: 2688 → 1 exactly, -5376 → 2, and a value that is not a multiple.
  std::vector<float> w(16, 0.5f);
  w[3] = 2688.0f;
  EXPECT_EQ(quantize_nvfp4(w, 1, 16).tensor_scale, 1.0f);
  w[3] = -5376.0f;
  EXPECT_EQ(quantize_nvfp4(w, 1, 16).tensor_scale, 2.0f);
  w[3] = 1.0f;
  EXPECT_EQ(quantize_nvfp4(w, 1, 16).tensor_scale, 1.0f / 2688.0f);
}

// Scales, codes and the exact per-element bound on fresh random data of every distribution and
// shape; the normalized error ‖w − deq‖ / ‖w‖, pooled over at least 8192 elements per case.
//
// Tolerances (measured over 2000 seeds per case, single tensors): gaussian ≈ 0.095 (the uniform
// rounding model predicts ~0.1: a block of 16 normals has amax ≈ 2σ, so S ≈ σ/3 and the three
// E2M1 intervals give error variance ≈ 0.011σ²), largest 0.098 at ≥ 8192 elements → 0.11.
// Heavy tails: t3 ≈ 0.09, gaussian with outliers ≈ 0.065, Cauchy ≈ 0.02 (its norm is a few
// huge elements, each within 0.375/5.66 ≈ 6.6% by the bound above) → 0.15.
TEST(QuantNvfp4, ScalesCodesAndErrorBoundsOnRandomData) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  for (const Dist dist : kAllDists) {
    for (const Shape& sh : kNvfp4Shapes) {
      SCOPED_TRACE(::testing::Message() << name(dist) << ", n = " << sh.n << ", k = " << sh.k);
      ErrorSums sums;
      while (sums.elements < 8192) {
        const std::vector<float> w = random_weights(gen, dist, sh.n * sh.k);
        const HostQuantWeights q = quantize_nvfp4(w, sh.n, sh.k);
        check_nvfp4(w, sh, q, sums);
        if (::testing::Test::HasFatalFailure()) return;
      }
      const double rel = std::sqrt(sums.err2 / sums.norm2);
      EXPECT_LT(rel, dist == Dist::kGaussian ? 0.11 : 0.15);
      EXPECT_GT(rel, 0.0);
    }
  }
}

TEST(QuantNvfp4, BlockScaleRoundingSaturationAndUnderflow) {
  // T = 1: one element 2688. Then per block: amax 50.4 → v = 8.4 → scale 8 → x = 6.3 saturates
  // to 6 (48, error 2.4 = 0.3·S); amax 51.6 → v = 8.6 → scale 9 → x = 5.73 → 6 (54);
  // amax 6·2^-10 → v = 2^-10, the tie between 0 and 2^-9 → scale 0 → codes 0; amax 6·2^-11 → 0.
  std::vector<float> w(5 * 16, 0.0f);
  w[0] = 2688.0f;
  w[16] = 50.4f;
  w[17] = -25.0f;
  w[32] = 51.6f;
  w[48] = 6.0f * 0x1p-10f;
  w[64] = -6.0f * 0x1p-11f;
  const HostQuantWeights q = quantize_nvfp4(w, 1, 80);
  EXPECT_EQ(q.tensor_scale, 1.0f);
  ASSERT_EQ(q.scales.size(), 5u);
  EXPECT_EQ(q.scales[0], 0x7E);  // 448
  EXPECT_EQ(num::e4m3_to_f32(q.scales[1]), 8.0f);
  EXPECT_EQ(num::e4m3_to_f32(q.scales[2]), 9.0f);
  EXPECT_EQ(q.scales[3], 0x00);
  EXPECT_EQ(q.scales[4], 0x00);
  const std::vector<float> d = dequantize(q);
  EXPECT_EQ(d[0], 2688.0f);
  EXPECT_EQ(q.code(0, 16), 7);
  EXPECT_EQ(d[16], 48.0f);
  EXPECT_EQ(d[17], -24.0f);  // -25 / 8 = -3.125 → -3
  EXPECT_EQ(q.code(0, 17), 13);
  EXPECT_EQ(d[32], 54.0f);
  EXPECT_EQ(d[48], 0.0f);
  EXPECT_EQ(d[64], 0.0f);
  EXPECT_EQ(q.code(0, 48), 0);
  EXPECT_EQ(q.code(0, 64), 0);
  ErrorSums sums;
  check_nvfp4(w, {1, 80}, q, sums);
}

TEST(QuantNvfp4, ZeroBlocksGiveZeroCodesAndScales) {
  // All zero (with negative zeros): tensor scale 1, every byte 0, dequantized +0.
  std::vector<float> zeros(3 * 48, 0.0f);
  for (std::size_t i = 0; i < zeros.size(); i += 3) zeros[i] = -0.0f;
  const HostQuantWeights z = quantize_nvfp4(zeros, 3, 48);
  EXPECT_EQ(z.tensor_scale, 1.0f);
  EXPECT_THAT(z.codes, ::testing::Each(0));
  EXPECT_THAT(z.scales, ::testing::Each(0));
  for (const float v : dequantize(z)) {
    EXPECT_EQ(v, 0.0f);
    EXPECT_FALSE(std::isnan(v));
  }
  // One zero block among random ones.
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  std::vector<float> w = random_weights(gen, Dist::kGaussian, 3 * 48);
  std::fill(w.begin() + 48 + 16, w.begin() + 48 + 32, 0.0f);  // row 1, block 1
  w[48 + 20] = -0.0f;
  const HostQuantWeights q = quantize_nvfp4(w, 3, 48);
  EXPECT_EQ(q.scales[1 * 3 + 1], 0);
  for (std::int64_t kk = 8; kk < 16; ++kk) EXPECT_EQ(q.codes[static_cast<std::size_t>(24 + kk)], 0);
  const std::vector<float> d = dequantize(q);
  for (const float v : d) EXPECT_FALSE(std::isnan(v));
  for (int j = 16; j < 32; ++j) EXPECT_EQ(d[static_cast<std::size_t>(48 + j)], 0.0f);
  ErrorSums sums;
  check_nvfp4(w, {3, 48}, q, sums);
}

TEST(QuantNvfp4, ExtremeMagnitudesStayFinite) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  for (const float top : {FLT_MAX, 1e30f, 1e-30f, 1e-38f, 1e-44f}) {
    SCOPED_TRACE(::testing::Message() << "absmax " << top);
    std::vector<float> w = random_weights(gen, Dist::kGaussian, 2 * 32);
    for (float& x : w) x *= top;  // |N(0, 0.02)| < 1, so the largest element is `top`
    w[5] = -top;
    const HostQuantWeights q = quantize_nvfp4(w, 2, 32);
    for (const float v : dequantize(q)) ASSERT_TRUE(std::isfinite(v));
    ErrorSums sums;
    check_nvfp4(w, {2, 32}, q, sums);
  }
}

// dequantize ∘ quantize fixes the dequantized values: quantizing them again gives the same
// codes, block scales and tensor scale, hence the same values, bit for bit. Why: a block with a
// normal E4M3 scale s has its largest code at ±6 (see the top of the file), so its dequantized
// amax is fl(6·s·T) and the new v is s·(1 ± 2^-24): s again; each element is c·S·(1 ± 2^-24):
// code c again; the new tensor absmax is fl(2688·T), and fl(fl(2688·T) / 2688) == T for every T
// the quantizer can produce (TensorScaleSurvivesTheRoundTrip). Not covered: a block whose E4M3
// scale is subnormal and whose largest code is below ±6 (block amax ~2-7 millionths of the
// tensor absmax) can come back with another scale, so Cauchy data is left out here.
TEST(QuantNvfp4, DequantizedValuesAreAFixedPoint) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  for (const Dist dist : {Dist::kGaussian, Dist::kStudentT3, Dist::kOutliers}) {
    for (const Shape& sh : kNvfp4Shapes) {
      SCOPED_TRACE(::testing::Message() << name(dist) << ", n = " << sh.n << ", k = " << sh.k);
      const std::vector<float> w = random_weights(gen, dist, sh.n * sh.k);
      const HostQuantWeights q = quantize_nvfp4(w, sh.n, sh.k);
      const std::vector<float> d = dequantize(q);
      const HostQuantWeights q2 = quantize_nvfp4(d, sh.n, sh.k);
      EXPECT_EQ(q2.tensor_scale, q.tensor_scale);
      EXPECT_EQ(q2.codes, q.codes);
      EXPECT_EQ(q2.scales, q.scales);
      EXPECT_EQ(dequantize(q2), d);
    }
  }
}

// The tensor scale T = fl(a / 2688) of any absmax a, dequantized as the absmax element
// fl(6 · 448 · T) and divided again, is T: checked for every float mantissa of a in [1, 2)
// (other binades scale by powers of two while T stays a normal float). This does not hold for
// an arbitrary float T (about 16% of mantissas move by one ulp), only for those the quantizer
// makes, which is what DequantizedValuesAreAFixedPoint relies on.
TEST(QuantNvfp4, TensorScaleSurvivesTheRoundTrip) {
  std::int64_t moved = 0;
  for (std::uint32_t m = 0; m < (1u << 23); ++m) {
    const float a = 1.0f + static_cast<float>(m) * 0x1p-23f;
    const float t = a / 2688.0f;
    const float top = static_cast<float>(2688.0 * static_cast<double>(t));
    if (top / 2688.0f != t) ++moved;
  }
  EXPECT_EQ(moved, 0);
  // End to end on a few of them.
  for (const float a : {1.0f, 1.3f, 1.7777777f, 1.9999999f, 3.0e-20f, 7.5e30f}) {
    std::vector<float> w(32, 0.25f * a);
    w[7] = -a;
    const HostQuantWeights q = quantize_nvfp4(w, 1, 32);
    const HostQuantWeights q2 = quantize_nvfp4(dequantize(q), 1, 32);
    EXPECT_EQ(q2.tensor_scale, q.tensor_scale) << a;
    EXPECT_EQ(dequantize(q2), dequantize(q)) << a;
  }
}

// ---- MXFP4 ----

// Tolerances (measured over 2000 seeds per case): gaussian ≈ 0.114 (power-of-two scales leave
// the block's amax anywhere in [4, 8)·S, coarser than NVFP4), largest 0.117 at ≥ 8192 elements
// → 0.13. Heavy tails: 0.12–0.15 on average, but a tensor whose norm is one huge element can
// lose up to 25% of it (x in [4, 8) maps to 4 or 6: at most 1/4 relative), measured up to 0.26
// on the smallest shapes → 0.3.
TEST(QuantMxfp4, ScalesCodesAndErrorBoundsOnRandomData) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  for (const Dist dist : kAllDists) {
    for (const Shape& sh : kMxfp4Shapes) {
      SCOPED_TRACE(::testing::Message() << name(dist) << ", n = " << sh.n << ", k = " << sh.k);
      ErrorSums sums;
      while (sums.elements < 8192) {
        const std::vector<float> w = random_weights(gen, dist, sh.n * sh.k);
        const HostQuantWeights q = quantize_mxfp4(w, sh.n, sh.k);
        check_mxfp4(w, sh, q, sums);
        if (::testing::Test::HasFatalFailure()) return;
      }
      const double rel = std::sqrt(sums.err2 / sums.norm2);
      EXPECT_LT(rel, dist == Dist::kGaussian ? 0.13 : 0.3);
      EXPECT_GT(rel, 0.0);
      EXPECT_LT(sums.max_x, 8.0);
    }
  }
}

TEST(QuantMxfp4, ScaleRuleAndSaturation) {
  std::vector<float> w(5 * 32, 0.0f);
  // Row 0: amax 1 → 2^(0-2): 1 → x = 4 exactly, 0.3 → x = 1.2 → 1 → 0.25.
  w[0] = 1.0f;
  w[1] = 0.3f;
  // Row 1: amax 7.5 → floor(log2) = 2 → scale 1: 7.5 and 6.9 saturate to 6, 5 ties to 4,
  // -7.99 → -6.
  w[32] = 7.5f;
  w[33] = 6.9f;
  w[34] = 5.0f;
  w[35] = -7.99f;
  // Row 2: amax 2^-126 → 2^-128 is below E8M0's range: clamped to 2^-127, x = 2 exactly.
  w[64] = FLT_MIN;
  // Row 3: FLT_MAX → 2^(127-2), x ≈ 8 → saturates to 6·2^125, finite.
  w[96] = -FLT_MAX;
  // Row 4: all zero → scale byte 0.
  const HostQuantWeights q = quantize_mxfp4(w, 5, 32);
  EXPECT_EQ(q.tensor_scale, 1.0f);
  ASSERT_EQ(q.scales.size(), 5u);
  EXPECT_EQ(q.scales[0], 125);
  EXPECT_EQ(q.scales[1], 127);
  EXPECT_EQ(q.scales[2], 0);
  EXPECT_EQ(q.scales[3], 252);
  EXPECT_EQ(q.scales[4], 0);
  const std::vector<float> d = dequantize(q);
  EXPECT_EQ(d[0], 1.0f);
  EXPECT_EQ(d[1], 0.25f);
  EXPECT_EQ(d[32], 6.0f);
  EXPECT_EQ(q.code(1, 0), 7);
  EXPECT_EQ(d[33], 6.0f);
  EXPECT_EQ(d[34], 4.0f);
  EXPECT_EQ(d[35], -6.0f);
  EXPECT_EQ(q.code(1, 3), 15);
  EXPECT_EQ(d[64], FLT_MIN);
  EXPECT_EQ(d[96], -0x1.8p+127f);
  for (int j = 128; j < 160; ++j) EXPECT_EQ(d[static_cast<std::size_t>(j)], 0.0f);
  EXPECT_EQ(q.scale(1, 5), 1.0f);
  EXPECT_EQ(q.scale(2, 0), 0x1p-127f);
  ErrorSums sums;
  check_mxfp4(w, {5, 32}, q, sums);
}

TEST(QuantMxfp4, ZeroBlocksGiveZeroCodesAndScales) {
  std::vector<float> zeros(3 * 96, -0.0f);
  const HostQuantWeights z = quantize_mxfp4(zeros, 3, 96);
  EXPECT_THAT(z.codes, ::testing::Each(0));
  EXPECT_THAT(z.scales, ::testing::Each(0));
  for (const float v : dequantize(z)) EXPECT_EQ(v, 0.0f);
}

TEST(QuantMxfp4, DequantizedValuesRoundTripExactly) {
  // Power-of-two scales: amax of the dequantized block is 4·S or 6·S, whose floor(log2) gives
  // the same S back, so one round trip already reproduces every value.
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  for (const Dist dist : kAllDists) {
    for (const Shape& sh : kMxfp4Shapes) {
      SCOPED_TRACE(::testing::Message() << name(dist) << ", n = " << sh.n << ", k = " << sh.k);
      const std::vector<float> w = random_weights(gen, dist, sh.n * sh.k);
      const HostQuantWeights q = quantize_mxfp4(w, sh.n, sh.k);
      const std::vector<float> d = dequantize(q);
      const HostQuantWeights q2 = quantize_mxfp4(d, sh.n, sh.k);
      EXPECT_EQ(q2.codes, q.codes);
      EXPECT_EQ(q2.scales, q.scales);
      EXPECT_EQ(dequantize(q2), d);
    }
  }
}

// ---- layouts ----

void check_layouts(const HostQuantWeights& q) {
  const int group = group_size(q.format);
  const std::int64_t n = q.n, k = q.k;
  const HostQuantWeights t = with_layout(q, WeightLayout::kTransposed);
  EXPECT_EQ(t.layout, WeightLayout::kTransposed);
  EXPECT_EQ(t.format, q.format);
  EXPECT_EQ(t.n, n);
  EXPECT_EQ(t.k, k);
  EXPECT_EQ(t.tensor_scale, q.tensor_scale);
  ASSERT_EQ(t.codes.size(), q.codes.size());
  ASSERT_EQ(t.scales.size(), q.scales.size());
  // Codes [K/2, N]: byte (kk, n) holds k = 2kk in the low nibble and 2kk + 1 in the high one.
  for (std::int64_t kk = 0; kk < k / 2; ++kk) {
    for (std::int64_t r = 0; r < n; ++r) {
      const std::uint8_t byte = t.codes[static_cast<std::size_t>(kk * n + r)];
      const std::uint8_t row_major = q.codes[static_cast<std::size_t>(r * (k / 2) + kk)];
      ASSERT_EQ(byte & 0xF, row_major & 0xF) << kk << ", " << r;
      ASSERT_EQ(byte & 0xF, q.code(r, 2 * kk));
      ASSERT_EQ(byte >> 4, q.code(r, 2 * kk + 1));
      ASSERT_EQ(num::packed_code(&row_major, 0), q.code(r, 2 * kk));
      ASSERT_EQ(num::packed_code(&row_major, 1), q.code(r, 2 * kk + 1));
    }
  }
  // Scales [K/group, N].
  for (std::int64_t b = 0; b < k / group; ++b) {
    for (std::int64_t r = 0; r < n; ++r) {
      ASSERT_EQ(t.scales[static_cast<std::size_t>(b * n + r)],
                q.scales[static_cast<std::size_t>(r * (k / group) + b)]);
    }
  }
  // The accessors agree across layouts.
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t c = 0; c < k; ++c) {
      ASSERT_EQ(t.code(r, c), q.code(r, c));
      ASSERT_EQ(t.scale(r, c), q.scale(r, c));
      ASSERT_EQ(t.weight(r, c), q.weight(r, c));
    }
  }
  EXPECT_EQ(dequantize(t), dequantize(q));
  // Back again, and a no-op conversion.
  const HostQuantWeights back = with_layout(t, WeightLayout::kRowMajor);
  EXPECT_EQ(back.layout, WeightLayout::kRowMajor);
  EXPECT_EQ(back.codes, q.codes);
  EXPECT_EQ(back.scales, q.scales);
  EXPECT_EQ(back.tensor_scale, q.tensor_scale);
  EXPECT_EQ(with_layout(q, WeightLayout::kRowMajor).codes, q.codes);
  EXPECT_EQ(with_layout(t, WeightLayout::kTransposed).codes, t.codes);
}

TEST(QuantLayout, TransposedRoundTripsAndAccessorsAgree) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  for (const Shape& sh : kNvfp4Shapes) {
    SCOPED_TRACE(::testing::Message() << "nvfp4 " << sh.n << "x" << sh.k);
    check_layouts(quantize_nvfp4(random_weights(gen, Dist::kOutliers, sh.n * sh.k), sh.n, sh.k));
  }
  for (const Shape& sh : kMxfp4Shapes) {
    SCOPED_TRACE(::testing::Message() << "mxfp4 " << sh.n << "x" << sh.k);
    check_layouts(quantize_mxfp4(random_weights(gen, Dist::kOutliers, sh.n * sh.k), sh.n, sh.k));
  }
}

TEST(QuantLayout, AccessorsDecodeByHand) {
  // A hand-made transposed NVFP4 tensor, n = 3, k = 16: byte (kk, n) = kk*3 + n.
  HostQuantWeights t;
  t.format = WeightFormat::kNvfp4;
  t.layout = WeightLayout::kTransposed;
  t.n = 3;
  t.k = 16;
  t.codes.resize(24);
  for (std::size_t i = 0; i < 24; ++i)
    t.codes[i] = static_cast<std::uint8_t>(0x10 * (i % 16) + i % 7);
  t.scales = {0x38, 0x40, 0x30};  // 1, 2, 0.5
  t.tensor_scale = 0.25f;
  for (std::int64_t r = 0; r < 3; ++r) {
    for (std::int64_t c = 0; c < 16; ++c) {
      const std::uint8_t byte = t.codes[static_cast<std::size_t>((c / 2) * 3 + r)];
      const std::uint8_t want = (c % 2) ? byte >> 4 : byte & 0xF;
      EXPECT_EQ(t.code(r, c), want);
      const float scale = (r == 0 ? 1.0f : r == 1 ? 2.0f : 0.5f) * 0.25f;
      EXPECT_EQ(t.scale(r, c), scale);
      EXPECT_EQ(t.weight(r, c), num::e2m1_to_f32(want) * scale);
    }
  }
}

// ---- names and errors ----

TEST(QuantApi, NamesAndGroups) {
  EXPECT_EQ(to_string(WeightFormat::kNvfp4), "nvfp4");
  EXPECT_EQ(to_string(WeightFormat::kMxfp4), "mxfp4");
  EXPECT_EQ(group_size(WeightFormat::kNvfp4), 16);
  EXPECT_EQ(group_size(WeightFormat::kMxfp4), 32);
}

void expect_invalid(const Error& e, const std::string& api, const std::string& text) {
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
  EXPECT_THAT(e.what(), StartsWith("[" + api + "] "));
  EXPECT_THAT(e.what(), HasSubstr(text));
}

TEST(QuantApi, BadInputsAreRejectedWithTheValue) {
  using testing::expect_error;
  const std::vector<float> w(3 * 100, 0.5f);
  expect_invalid(expect_error([&] { quantize_nvfp4(w, 3, 100); }), "quantize_nvfp4",
                 "k = 100 is not a multiple of 16");
  expect_invalid(expect_error([&] { quantize_mxfp4(w, 3, 48); }), "quantize_mxfp4",
                 "k = 48 is not a multiple of 32");
  expect_invalid(expect_error([&] { quantize_nvfp4(w, 0, 16); }), "quantize_nvfp4",
                 "n = 0 must be positive");
  expect_invalid(expect_error([&] { quantize_mxfp4(w, -2, 32); }), "quantize_mxfp4",
                 "n = -2 must be positive");
  expect_invalid(expect_error([&] { quantize_nvfp4(w, 3, 0); }), "quantize_nvfp4",
                 "k = 0 must be positive");
  expect_invalid(expect_error([&] { quantize_nvfp4(w, 3, -16); }), "quantize_nvfp4",
                 "k = -16 must be positive");
  expect_invalid(expect_error([&] { quantize_nvfp4(w, 3, 96); }), "quantize_nvfp4",
                 "w has 300 elements, but n * k = 3 * 96 = 288");
  expect_invalid(expect_error([&] { quantize_mxfp4(std::span<const float>{}, 1, 32); }),
                 "quantize_mxfp4", "w has 0 elements");
  expect_invalid(
      expect_error([&] { quantize_nvfp4(w, std::int64_t{1} << 40, std::int64_t{1} << 40); }),
      "quantize_nvfp4", "overflows");

  std::vector<float> bad(2 * 32, 1.0f);
  bad[32 + 5] = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(expect_error([&] { quantize_nvfp4(bad, 2, 32); }), "quantize_nvfp4",
                 "w[1, 5] = nan is not finite");
  bad[32 + 5] = 1.0f;
  bad[3] = -std::numeric_limits<float>::infinity();
  expect_invalid(expect_error([&] { quantize_mxfp4(bad, 2, 32); }), "quantize_mxfp4",
                 "w[0, 3] = -inf is not finite");
  bad[3] = std::numeric_limits<float>::infinity();
  expect_invalid(expect_error([&] { quantize_nvfp4(bad, 1, 64); }), "quantize_nvfp4",
                 "w[0, 3] = inf is not finite");
}

TEST(QuantApi, MalformedWeightsAndIndicesAreRejected) {
  using testing::expect_error;
  const std::vector<float> w(3 * 48, 0.5f);
  const HostQuantWeights q = quantize_nvfp4(w, 3, 48);
  expect_invalid(expect_error([&] { (void)q.code(3, 0); }), "HostQuantWeights::code",
                 "(3, 0) is outside the 3 x 48 weights");
  expect_invalid(expect_error([&] { (void)q.scale(0, 48); }), "HostQuantWeights::scale",
                 "(0, 48) is outside");
  expect_invalid(expect_error([&] { (void)q.weight(-1, 0); }), "HostQuantWeights::weight",
                 "(-1, 0) is outside");
  HostQuantWeights short_codes = q;
  short_codes.codes.pop_back();
  expect_invalid(expect_error([&] { dequantize(short_codes); }), "dequantize",
                 "need 72 code bytes and 9 scale bytes, got 71 and 9");
  HostQuantWeights bad_k = q;
  bad_k.format = WeightFormat::kMxfp4;  // k = 48 is no multiple of 32
  expect_invalid(expect_error([&] { with_layout(bad_k, WeightLayout::kTransposed); }),
                 "with_layout", "bad shape n = 3, k = 48 for mxfp4");
  HostQuantWeights empty;
  expect_invalid(expect_error([&] { dequantize(empty); }), "dequantize", "bad shape n = 0");
}

}  // namespace
}  // namespace metrale

namespace metrale {
namespace {

// A rank's shard is the same weights as the rows or columns it covers of the whole layer.
TEST(QuantSlices, RowsAndColumnsAreTheWholeLayersWeights) {
  std::mt19937 gen(std::random_device{}());
  for (const WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    const std::int64_t group = group_size(format);
    const std::int64_t n = 1 + static_cast<std::int64_t>(gen() % 40);
    const std::int64_t k = group * (2 + static_cast<std::int64_t>(gen() % 6));
    std::vector<float> values(static_cast<std::size_t>(n * k));
    std::normal_distribution<float> normal;
    for (float& v : values) v = normal(gen);
    const HostQuantWeights w = format == WeightFormat::kNvfp4 ? quantize_nvfp4(values, n, k)
                                                              : quantize_mxfp4(values, n, k);
    const std::vector<float> whole = dequantize(w);
    const std::int64_t r0 = static_cast<std::int64_t>(gen() % n);
    const std::int64_t r1 = r0 + 1 + static_cast<std::int64_t>(gen() % (n - r0));
    const std::vector<float> rows = dequantize(slice_rows(w, r0, r1));
    ASSERT_EQ(rows.size(), static_cast<std::size_t>((r1 - r0) * k));
    EXPECT_TRUE(std::equal(rows.begin(), rows.end(), whole.begin() + r0 * k));
    const std::int64_t c0 = group * static_cast<std::int64_t>(gen() % (k / group));
    const std::int64_t c1 =
        c0 + group * (1 + static_cast<std::int64_t>(gen() % ((k - c0) / group)));
    const HostQuantWeights cols = slice_columns(w, c0, c1);
    EXPECT_EQ(cols.k, c1 - c0);
    EXPECT_EQ(cols.tensor_scale, w.tensor_scale);
    const std::vector<float> got = dequantize(cols);
    for (std::int64_t r = 0; r < n; ++r) {
      for (std::int64_t c = c0; c < c1; ++c) {
        ASSERT_EQ(got[static_cast<std::size_t>(r * (c1 - c0) + c - c0)],
                  whole[static_cast<std::size_t>(r * k + c)])
            << "row " << r << " column " << c;
      }
    }
    EXPECT_THROW(slice_columns(w, 1, group + 1), Error);  // off the group
    EXPECT_THROW(slice_rows(w, 0, n + 1), Error);
    EXPECT_THROW(slice_rows(with_layout(w, WeightLayout::kTransposed), 0, 1), Error);
  }
}

// stack_rows: the stack's row r is the row of the part that holds it, exactly, for each format
// (INT4 with zero points and FP16 scales too); parts that cannot share one description are
// refused by the field that differs.
TEST(QuantStack, RowsAreThePartsRowsInOrder) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  const std::int64_t k = 128;
  const auto make = [&](WeightFormat f, std::int64_t n) {
    const std::vector<float> w = random_weights(gen, Dist::kGaussian, n * k);
    if (f == WeightFormat::kNvfp4) return quantize_nvfp4(w, n, k);
    if (f == WeightFormat::kMxfp4) return quantize_mxfp4(w, n, k);
    return quantize_int4(w, n, k, 32, true, true);
  };
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4, WeightFormat::kInt4}) {
    SCOPED_TRACE(to_string(f));
    std::vector<HostQuantWeights> parts{make(f, 48), make(f, 16), make(f, 32)};
    for (auto& p : parts) p.tensor_scale = parts[0].tensor_scale;  // as the producers fuse them
    const HostQuantWeights s = stack_rows(parts);
    ASSERT_EQ(s.n, 96);
    std::int64_t row = 0;
    for (const auto& p : parts) {
      for (std::int64_t r = 0; r < p.n; ++r, ++row) {
        for (std::int64_t c = 0; c < k; ++c) {
          ASSERT_EQ(s.exact_weight(row, c), p.exact_weight(r, c)) << "row " << row << " col " << c;
        }
      }
    }
  }
  std::vector<HostQuantWeights> two{make(WeightFormat::kNvfp4, 16), make(WeightFormat::kNvfp4, 16)};
  two[1].tensor_scale = two[0].tensor_scale * 2.0f;
  EXPECT_ERROR(stack_rows(two), ErrorCode::kInvalidArgument, "parts[1]: tensor scale");
  two[1] = make(WeightFormat::kMxfp4, 16);
  EXPECT_ERROR(stack_rows(two), ErrorCode::kInvalidArgument, "parts[1]: format mxfp4");
  two[1] = with_layout(two[0], WeightLayout::kTransposed);
  EXPECT_ERROR(stack_rows(two), ErrorCode::kInvalidArgument, "parts[1]: the transposed layout");
  two[1] = quantize_nvfp4(random_weights(gen, Dist::kGaussian, 16 * 64), 16, 64);
  two[1].tensor_scale = two[0].tensor_scale;
  EXPECT_ERROR(stack_rows(two), ErrorCode::kInvalidArgument,
               "parts[1]: K 64, but parts[0] has 128");
  const auto ints = [&] {
    return std::vector<HostQuantWeights>{make(WeightFormat::kInt4, 16),
                                         make(WeightFormat::kInt4, 16)};
  };
  std::vector<HostQuantWeights> bad = ints();
  bad[1].zeros.clear();
  EXPECT_ERROR(stack_rows(bad), ErrorCode::kInvalidArgument, "parts[1]: zero points none");
  bad = ints();
  bad[1] = quantize_int4(random_weights(gen, Dist::kGaussian, 16 * k), 16, k, 64, true, true);
  EXPECT_ERROR(stack_rows(bad), ErrorCode::kInvalidArgument, "parts[1]: group 64");
  bad = ints();
  bad[1] = quantize_int4(random_weights(gen, Dist::kGaussian, 16 * k), 16, k, 32, true, false);
  EXPECT_ERROR(stack_rows(bad), ErrorCode::kInvalidArgument, "parts[1]: scales BF16");
  bad = ints();
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
  for (std::int64_t c = 0; c < k; ++c)
    g_idx[static_cast<std::size_t>(c)] = static_cast<std::int32_t>((k - 1 - c) / 32);
  bad[1] = with_act_order(bad[1], g_idx);
  EXPECT_ERROR(stack_rows(bad), ErrorCode::kInvalidArgument, "parts[1]: act order stored");
  // One K order for all (an expert's gate and up under GPTQ's desc_act): stacked, order kept.
  bad[0] = with_act_order(bad[0], g_idx);
  const HostQuantWeights ordered = stack_rows(bad);
  EXPECT_EQ(ordered.k_perm, bad[0].k_perm);
  for (std::int64_t c = 0; c < k; ++c) {
    ASSERT_EQ(ordered.exact_weight(16 + 3, c), bad[1].exact_weight(3, c)) << "col " << c;
  }
  std::shuffle(g_idx.begin(), g_idx.end(), gen);
  bad[1] = with_act_order(ints()[1], g_idx);
  EXPECT_ERROR(stack_rows(bad), ErrorCode::kInvalidArgument,
               "parts[1]: act order in another K order, but parts[0] has its own");
  EXPECT_ERROR(stack_rows({}), ErrorCode::kInvalidArgument, "no parts");
}

// take_rows: row i is W's row rows[i], exactly, in every format (INT4 with zero points, FP16
// scales and act order); in_stored_order: W'[:, j] = W[:, k_perm[j]] and no act order left, the
// fold of an expert's down act order into its gate_up rows (Note [Experts' act order]).
TEST(QuantRows, TakenRowsAndTheStoredOrderKeepEveryWeight) {
  const unsigned seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 gen(seed);
  const std::int64_t n = 24, k = 256;
  const std::vector<float> values = random_weights(gen, Dist::kGaussian, n * k);
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
  for (std::int64_t c = 0; c < k; ++c)
    g_idx[static_cast<std::size_t>(c)] = static_cast<std::int32_t>(c / 64);
  std::shuffle(g_idx.begin(), g_idx.end(), gen);
  const HostQuantWeights act = with_act_order(quantize_int4(values, n, k, 64, true, true), g_idx);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), gen);
  rows.push_back(rows[0]);  // a row twice is still that row
  for (const HostQuantWeights& w :
       {act, quantize_nvfp4(values, n, k), quantize_mxfp4(values, n, k)}) {
    SCOPED_TRACE(to_string(w.format));
    const HostQuantWeights t = take_rows(w, rows);
    ASSERT_EQ(t.n, n + 1);
    EXPECT_EQ(t.k_perm, w.k_perm);
    for (std::int64_t r = 0; r <= n; ++r) {
      for (std::int64_t c = 0; c < k; ++c) {
        ASSERT_EQ(t.exact_weight(r, c), w.exact_weight(rows[r], c)) << "row " << r << " col " << c;
      }
    }
  }
  const HostQuantWeights stored = in_stored_order(act);
  ASSERT_TRUE(stored.k_perm.empty());
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t j = 0; j < k; ++j) {
      ASSERT_EQ(stored.exact_weight(r, j), act.exact_weight(r, act.k_perm[j])) << r << ", " << j;
    }
  }
  EXPECT_ERROR(take_rows(act, std::vector<std::int64_t>{0, n}), ErrorCode::kInvalidArgument,
               "rows[1] = 24 is outside the 24 rows");
  EXPECT_ERROR(take_rows(act, {}), ErrorCode::kInvalidArgument, "no rows");
  EXPECT_ERROR(
      take_rows(with_layout(quantize_nvfp4(values, n, k), WeightLayout::kTransposed), rows),
      ErrorCode::kInvalidArgument, "transposed");
  EXPECT_ERROR(in_stored_order(slice_columns(act, 0, k / 2)), ErrorCode::kInvalidArgument,
               "a K slice");
}

}  // namespace
}  // namespace metrale
