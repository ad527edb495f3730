// The block-scaled E4M3 quantizers of metrale/e4m3_block.h against float64 references
// (core/numerics_reference.h): 128 x 128 weight blocks from FP32, BF16, NVFP4 and MXFP4, and the
// activation cast with one scale per row per 128 K stored [ceil(K/128), M].
//
// The error bound. With s a block's scale and q = w / s, the code is the nearest E4M3 of q, and
// |q| <= 448 (1 + 2^-23) since s is amax / 448 rounded to FP32. In E4M3's normal range
// (|q| >= 2^-6) the spacing is 2^(e-3) for q in [2^e, 2^(e+1)), so the nearest value is within
// 2^(e-4) <= 2^-4 |q|; in the subnormal range the spacing is 2^-9, half of it 2^-10; a q past 448
// saturates, off by at most 448 x 2^-23 < 2^-4 |q|. Hence, exactly in float64,
//   |e4m3(code) x s - w| <= max(2^-4 |w|, 2^-10 s),
// and normalized by the block's amax (s ~ amax / 448) the error is at most 2^-4. The activation
// cast divides in FP32 first, which adds 2^-24 |q|: there the bound carries a factor 1 + 2^-20.
#include "metrale/e4m3_block.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "core/numerics_reference.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"

namespace metrale {
namespace {

namespace ref = testing::ref;
using ::testing::HasSubstr;

constexpr double kRelStep = 0.0625;             // 2^-4: half of E4M3's relative spacing
constexpr double kSubnormalHalfStep = 0x1p-10;  // half of E4M3's subnormal spacing 2^-9
constexpr std::uint8_t kPoisonCode = 0x7F;      // NaN: no quantizer writes it for finite input

struct Shape {
  std::int64_t n, k;
};
// Partial blocks on either axis, one block, several blocks.
const Shape kShapes[] = {{1, 1}, {3, 5}, {128, 128}, {130, 300}, {257, 129}};

// Gaussian weights whose scale changes from block to block (by up to 2^±12), so the scales
// differ and a block read with its neighbour's scale fails.
std::vector<float> random_weights(std::int64_t n, std::int64_t k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g(0.0, 1.0);
  std::uniform_int_distribution<int> e(-12, 12);
  std::vector<int> block_exp(static_cast<std::size_t>(e4m3_blocks(n) * e4m3_blocks(k)));
  for (int& x : block_exp) x = e(rng);
  std::vector<float> w(static_cast<std::size_t>(n * k));
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t c = 0; c < k; ++c) {
      const int be = block_exp[static_cast<std::size_t>((r / 128) * e4m3_blocks(k) + c / 128)];
      w[static_cast<std::size_t>(r * k + c)] = static_cast<float>(std::ldexp(g(rng), be));
    }
  }
  return w;
}

// Checks quantized block-scaled weights against the exact values value(r, c): each scale is
// amax / 448 rounded to FP32, each code the reference's nearest E4M3 of w / s, each error within
// the bound. Returns the largest error normalized by its block's amax.
template <class Value>
double check_against_reference(const E4m3BlockWeightsView& q, Value value) {
  const std::int64_t kb = e4m3_blocks(q.k);
  double worst = 0.0;
  for (std::int64_t br = 0; br < e4m3_blocks(q.n); ++br) {
    for (std::int64_t bc = 0; bc < kb; ++bc) {
      const std::int64_t r1 = std::min(q.n, (br + 1) * 128), c1 = std::min(q.k, (bc + 1) * 128);
      double amax = 0.0;
      for (std::int64_t r = br * 128; r < r1; ++r) {
        for (std::int64_t c = bc * 128; c < c1; ++c) amax = std::max(amax, std::fabs(value(r, c)));
      }
      const float s = q.scales[static_cast<std::size_t>(br * kb + bc)];
      const float want_s = amax == 0.0 ? 1.0f : static_cast<float>(amax / 448.0);
      EXPECT_EQ(s, want_s) << "block (" << br << ", " << bc << ")";
      for (std::int64_t r = br * 128; r < r1; ++r) {
        for (std::int64_t c = bc * 128; c < c1; ++c) {
          const double w = value(r, c);
          const std::uint8_t code = q.codes[static_cast<std::size_t>(r * q.k + c)];
          EXPECT_EQ(code, ref::nearest_e4m3(w / static_cast<double>(s)))
              << "(" << r << ", " << c << ") w = " << w;
          const double err = std::fabs(ref::e4m3_value(code) * static_cast<double>(s) - w);
          EXPECT_LE(err, std::max(kRelStep * std::fabs(w), kSubnormalHalfStep * s))
              << "(" << r << ", " << c << ") w = " << w;
          if (amax > 0.0) worst = std::max(worst, err / amax);
        }
      }
    }
  }
  return worst;
}

double at(const std::vector<float>& w, std::int64_t k, std::int64_t r, std::int64_t c) {
  return static_cast<double>(w[static_cast<std::size_t>(r * k + c)]);
}

// ---- weights from FP32 and BF16 ----

TEST(E4m3Block, BlockCountsRoundUp) {
  EXPECT_EQ(e4m3_blocks(0), 0);
  EXPECT_EQ(e4m3_blocks(1), 1);
  EXPECT_EQ(e4m3_blocks(128), 1);
  EXPECT_EQ(e4m3_blocks(129), 2);
  EXPECT_EQ(e4m3_blocks(7168), 56);
}

TEST(E4m3Block, WeightsMatchTheFloat64Reference) {
  std::uint64_t seed = 1;
  for (const Shape sh : kShapes) {
    SCOPED_TRACE(::testing::Message() << sh.n << " x " << sh.k);
    const std::vector<float> w = random_weights(sh.n, sh.k, seed++);
    const HostE4m3BlockWeights q = quantize_e4m3_block128(w, sh.n, sh.k);
    ASSERT_EQ(q.codes.size(), static_cast<std::size_t>(sh.n * sh.k));
    ASSERT_EQ(q.scales.size(), static_cast<std::size_t>(e4m3_blocks(sh.n) * e4m3_blocks(sh.k)));
    const double worst = check_against_reference(
        q.view(), [&](std::int64_t r, std::int64_t c) { return at(w, sh.k, r, c); });
    EXPECT_LE(worst, kRelStep);
    // Not vacuous: with more than a handful of weights some error is a sizeable part of a step.
    if (sh.n * sh.k > 100) {
      EXPECT_GT(worst, kRelStep / 16);
    }
    // dequantize and the view's accessors read the same values.
    const std::vector<float> d = dequantize(q.view());
    for (std::int64_t i = 0; i < sh.n * sh.k; i += 97) {
      EXPECT_EQ(d[static_cast<std::size_t>(i)],
                static_cast<float>(q.view().weight(i / sh.k, i % sh.k)));
    }
  }
}

TEST(E4m3Block, Bf16WeightsQuantizeAsTheirFp32Values) {
  const std::int64_t n = 130, k = 300;
  const std::vector<float> f = random_weights(n, k, 7);
  std::vector<std::uint16_t> h(f.size());
  std::vector<float> widened(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) {
    h[i] = num::f32_to_bf16(f[i]);
    widened[i] = num::bf16_to_f32(h[i]);
  }
  const HostE4m3BlockWeights a = quantize_e4m3_block128_bf16(h, n, k);
  const HostE4m3BlockWeights b = quantize_e4m3_block128(widened, n, k);
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.scales, b.scales);
  check_against_reference(a.view(),
                          [&](std::int64_t r, std::int64_t c) { return at(widened, k, r, c); });
}

// Every finite E4M3 code times a power-of-two scale, in a block whose amax is 448 x that scale,
// comes back as itself (the scale is then exact).
TEST(E4m3Block, EveryE4m3CodeRoundTrips) {
  constexpr double kScale = 0x1p-5;
  std::vector<float> w;
  std::vector<std::uint8_t> want;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    w.push_back(static_cast<float>(ref::e4m3_value(static_cast<std::uint8_t>(c)) * kScale));
    want.push_back(static_cast<std::uint8_t>(c));
  }
  ASSERT_EQ(w.size(), 254u);
  for (const std::uint8_t pad : {std::uint8_t{0x7E}, std::uint8_t{0xFE}}) {
    w.push_back(static_cast<float>(ref::e4m3_value(pad) * kScale));
    want.push_back(pad);
  }
  // Weights: one 2 x 128 block.
  const HostE4m3BlockWeights q = quantize_e4m3_block128(w, 2, 128);
  EXPECT_THAT(q.scales, ::testing::ElementsAre(static_cast<float>(kScale)));
  EXPECT_EQ(q.codes, want);
  // Activations: one row of 256 (every E4M3 value is a BF16), codes 0x00-0x7E and 448 in the
  // first 128-K block, 0x80-0xFE and -448 in the second, so both scales are exact.
  std::vector<float> row;
  std::vector<std::uint8_t> row_want;
  for (int i = 0; i < 256; ++i) {
    const int c = i == 0x7F ? 0x7E : i == 0xFF ? 0xFE : i;  // the pad in place of NaN
    row.push_back(static_cast<float>(ref::e4m3_value(static_cast<std::uint8_t>(c)) * kScale));
    row_want.push_back(static_cast<std::uint8_t>(c));
  }
  std::vector<std::uint16_t> a(row.size());
  for (std::size_t i = 0; i < row.size(); ++i) {
    a[i] = num::f32_to_bf16(row[i]);
    ASSERT_EQ(num::bf16_to_f32(a[i]), row[i]) << i;
  }
  const HostE4m3Activations qa = quantize_e4m3_activations(a, 1, 256);
  EXPECT_THAT(qa.scales,
              ::testing::ElementsAre(static_cast<float>(kScale), static_cast<float>(kScale)));
  EXPECT_EQ(qa.codes, row_want);
}

TEST(E4m3Block, ZeroAndTinyBlocks) {
  // Block (0, 1) all zero (scale 1, codes 0, and -0 stays 0x80); block (0, 0) of the smallest
  // float, whose amax / 448 underflows: its scale is the smallest float and the weight code 1.0.
  const std::int64_t n = 2, k = 200;
  std::vector<float> w(static_cast<std::size_t>(n * k), 0.0f);
  w[1] = -0.0f;
  w[k + 150] = -0.0f;
  for (int c = 0; c < 128; ++c) w[static_cast<std::size_t>(c)] = 0x1p-149f;
  const HostE4m3BlockWeights q = quantize_e4m3_block128(w, n, k);
  EXPECT_THAT(q.scales, ::testing::ElementsAre(std::numeric_limits<float>::denorm_min(), 1.0f));
  EXPECT_EQ(q.codes[0], 0x38);  // 1.0
  EXPECT_EQ(q.codes[static_cast<std::size_t>(k + 150)], 0x80);
  EXPECT_EQ(q.codes[static_cast<std::size_t>(k + 5)], 0x00);
  // Activations: a zero block gets scale 1 too.
  std::vector<std::uint16_t> a(2 * 130, 0);
  a[3] = num::f32_to_bf16(2.0f);
  const HostE4m3Activations qa = quantize_e4m3_activations(a, 2, 130);
  EXPECT_THAT(qa.scales, ::testing::ElementsAre(2.0f / 448.0f, 1.0f, 1.0f, 1.0f));
  EXPECT_EQ(qa.codes[3], 0x7E);
}

// ---- NVFP4 and MXFP4 requantized ----

TEST(E4m3Block, RequantizesNvfp4AndMxfp4FromTheirExactValues) {
  for (const WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      SCOPED_TRACE(::testing::Message()
                   << to_string(format) << " layout " << static_cast<int>(layout));
      const std::int64_t n = 130, k = 288;  // a multiple of 16 and of 32
      const std::vector<float> f = random_weights(n, k, 11);
      const HostQuantWeights w = with_layout(
          format == WeightFormat::kNvfp4 ? quantize_nvfp4(f, n, k) : quantize_mxfp4(f, n, k),
          layout);
      const HostE4m3BlockWeights q = requantize_e4m3_block128(w);
      ASSERT_EQ(q.n, n);
      ASSERT_EQ(q.k, k);
      // Against the NVFP4/MXFP4 weights in float64 (e2m1 x block scale x tensor scale written
      // out from the format definitions, not through exact_weight).
      const auto exact = [&](std::int64_t r, std::int64_t c) {
        const std::uint8_t code = w.code(r, c);  // whatever the layout
        const int group = group_size(format);
        const std::size_t si = static_cast<std::size_t>(
            layout == WeightLayout::kRowMajor ? r * (k / group) + c / group : (c / group) * n + r);
        const double bs = format == WeightFormat::kNvfp4 ? ref::e4m3_value(w.scales[si])
                                                         : ref::e8m0_value(w.scales[si]);
        return ref::e2m1_value(code) * bs * static_cast<double>(w.tensor_scale);
      };
      EXPECT_LE(check_against_reference(q.view(), exact), kRelStep);
    }
  }
  // MXFP4's dequantized FP32 values are exact, so requantizing equals quantizing them.
  const std::vector<float> f = random_weights(130, 288, 12);
  const HostQuantWeights mx = quantize_mxfp4(f, 130, 288);
  const HostE4m3BlockWeights a = requantize_e4m3_block128(mx);
  const HostE4m3BlockWeights b = quantize_e4m3_block128(dequantize(mx), 130, 288);
  EXPECT_EQ(a.codes, b.codes);
  EXPECT_EQ(a.scales, b.scales);
}

TEST(E4m3Block, RequantizingOnThreadsGivesTheSameBytesAndTheFirstError) {
  const std::int64_t n = 5 * 128 + 7, k = 288;  // six block rows, the last partial
  const std::vector<float> f = random_weights(n, k, 13);
  const HostQuantWeights w = quantize_nvfp4(f, n, k);
  const HostE4m3BlockWeights one = requantize_e4m3_block128(w);
  for (const int threads : {2, 3, 6, 64}) {
    const HostE4m3BlockWeights many = requantize_e4m3_block128(w, threads);
    EXPECT_EQ(many.codes, one.codes) << threads << " threads";
    EXPECT_EQ(many.scales, one.scales) << threads << " threads";
  }
  // NaN block scales in block rows 4 and 1: the error names the one of the lower row, however
  // the rows are shared out.
  HostQuantWeights bad = w;
  bad.scales[static_cast<std::size_t>(4 * 128 * (k / 16))] = 0x7F;  // row 512, k 0..15
  bad.scales[static_cast<std::size_t>(200 * (k / 16) + 3)] = 0x7F;  // row 200, k 48..63
  for (const int threads : {1, 2, 4}) {
    const Error e = testing::expect_error([&] { (void)requantize_e4m3_block128(bad, threads); });
    EXPECT_THAT(e.what(), HasSubstr("weight [200, 48] = nan")) << threads << " threads";
  }
}

TEST(E4m3Block, RequantizesMxfp4BeyondTheFp32Range) {
  // E8M0 2^127 times E2M1 6 is 1.5 x 2^129, past FLT_MAX: no FP32 step in between, so the
  // block scale 6 x 2^127 / 448 is exact enough and the code is 448.
  HostQuantWeights w;
  w.format = WeightFormat::kMxfp4;
  w.n = 1;
  w.k = 32;
  w.codes.assign(16, 0x77);  // every E2M1 code 6
  w.scales.assign(1, 254);   // 2^127
  const HostE4m3BlockWeights q = requantize_e4m3_block128(w);
  EXPECT_EQ(q.scales[0], static_cast<float>(6.0 * 0x1p127 / 448.0));
  EXPECT_TRUE(std::isfinite(q.scales[0]));
  EXPECT_EQ(q.codes, std::vector<std::uint8_t>(32, 0x7E));
}

TEST(E4m3Block, RequantizeRefusesNonFiniteWeights) {
  std::vector<float> f(4 * 32, 1.0f);
  HostQuantWeights w = quantize_nvfp4(f, 4, 32);
  w.scales[5] = 0x7F;  // NaN block scale: row 2, k 16-31
  Error e = testing::expect_error([&] { (void)requantize_e4m3_block128(w); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[requantize_e4m3_block128] nvfp4 weight [2, 16] = nan is not "
                                  "finite"));
  w = quantize_nvfp4(f, 4, 32);
  w.codes.pop_back();
  e = testing::expect_error([&] { (void)requantize_e4m3_block128(w); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[requantize_e4m3_block128] nvfp4 weights of n = 4, k = 32 "
                                  "need 64 code bytes and 8 scale bytes, got 63 and 8"));
}

// ---- activations ----

TEST(E4m3Block, ActivationScalesAreStoredKBlockMajor) {
  // A[3, 300]: three 128-K blocks (the last of 44), each (row, block) with its own amax, so a
  // transposed store or a shifted block fails.
  const std::int64_t m = 3, k = 300;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t c = 0; c < k; ++c) {
      const double mag = std::ldexp(1.0, static_cast<int>(4 * r + c / 128));
      a[static_cast<std::size_t>(r * k + c)] = num::f32_to_bf16(static_cast<float>(u(rng) * mag));
    }
  }
  const HostE4m3Activations q = quantize_e4m3_activations(a, m, k);
  ASSERT_EQ(q.scales.size(), 9u);
  double worst = 0.0;
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t b = 0; b < 3; ++b) {
      const std::int64_t c1 = std::min(k, (b + 1) * 128);
      float amax = 0.0f;
      for (std::int64_t c = b * 128; c < c1; ++c) {
        amax = std::max(
            amax,
            static_cast<float>(std::fabs(ref::bf16_value(a[static_cast<std::size_t>(r * k + c)]))));
      }
      const float s = q.scales[static_cast<std::size_t>(b * m + r)];  // [ceil(K/128), M]
      EXPECT_EQ(s, amax / 448.0f) << "row " << r << " block " << b;
      for (std::int64_t c = b * 128; c < c1; ++c) {
        const double v = ref::bf16_value(a[static_cast<std::size_t>(r * k + c)]);
        const std::uint8_t code = q.codes[static_cast<std::size_t>(r * k + c)];
        // The FP32 quotient, then the reference's nearest E4M3.
        EXPECT_EQ(code, ref::nearest_e4m3(static_cast<double>(static_cast<float>(v) / s)))
            << r << ", " << c;
        const double err = std::fabs(ref::e4m3_value(code) * static_cast<double>(s) - v);
        EXPECT_LE(err, std::max(kRelStep * std::fabs(v), kSubnormalHalfStep * s) * (1.0 + 0x1p-20))
            << r << ", " << c;
        worst = std::max(worst, err / static_cast<double>(amax));
      }
    }
  }
  EXPECT_LE(worst, kRelStep * (1.0 + 0x1p-20));
  EXPECT_GT(worst, kRelStep / 16);
}

// ---- outputs, poisoned first; bad arguments ----

TEST(E4m3Block, EveryOutputIsWrittenAndNothingOnError) {
  const std::int64_t n = 130, k = 300;
  const std::vector<float> w = random_weights(n, k, 3);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(n * k), kPoisonCode);
  std::vector<float> scales(6, nan);
  quantize_e4m3_block128(w, n, k, codes, scales);
  EXPECT_EQ(std::count(codes.begin(), codes.end(), kPoisonCode), 0);
  EXPECT_EQ(std::count_if(scales.begin(), scales.end(), [](float s) { return !(s > 0.0f); }), 0);

  // A short output, or a non-finite weight: an error, and the poison stays.
  std::fill(codes.begin(), codes.end(), kPoisonCode);
  std::fill(scales.begin(), scales.end(), nan);
  Error e = testing::expect_error(
      [&] { quantize_e4m3_block128(w, n, k, codes, std::span<float>(scales).first(5)); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[quantize_e4m3_block128] scales has 5 elements, but "
                                  "ceil(n / 128) * ceil(k / 128) for n = 130, k = 300 needs 6"));
  std::vector<float> bad = w;
  bad[static_cast<std::size_t>(129 * k + 7)] = std::numeric_limits<float>::infinity();
  e = testing::expect_error([&] { quantize_e4m3_block128(bad, n, k, codes, scales); });
  EXPECT_THAT(e.what(), HasSubstr("[quantize_e4m3_block128] w[129, 7] = inf is not finite"));
  EXPECT_EQ(std::count(codes.begin(), codes.end(), kPoisonCode), n * k);
  EXPECT_EQ(std::count_if(scales.begin(), scales.end(), [](float s) { return std::isnan(s); }), 6);

  // Activations, the same.
  const std::int64_t m = 5;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = num::f32_to_bf16(w[i]);
  std::vector<std::uint8_t> ac(static_cast<std::size_t>(m * k), kPoisonCode);
  std::vector<float> as(3 * m, nan);
  quantize_e4m3_activations(a, m, k, ac, as);
  EXPECT_EQ(std::count(ac.begin(), ac.end(), kPoisonCode), 0);
  EXPECT_EQ(std::count_if(as.begin(), as.end(), [](float s) { return !(s > 0.0f); }), 0);
  std::fill(ac.begin(), ac.end(), kPoisonCode);
  std::fill(as.begin(), as.end(), nan);
  a[static_cast<std::size_t>(2 * k + 299)] = 0x7FC0;  // NaN
  e = testing::expect_error([&] { quantize_e4m3_activations(a, m, k, ac, as); });
  EXPECT_THAT(e.what(), HasSubstr("[quantize_e4m3_activations] a[2, 299] = nan (BF16 0x7FC0) is "
                                  "not finite"));
  a[static_cast<std::size_t>(2 * k + 299)] = 0;
  e = testing::expect_error(
      [&] { quantize_e4m3_activations(a, m, k, ac, std::span<float>(as).first(3 * m - 1)); });
  EXPECT_THAT(e.what(), HasSubstr("scales has 14 elements, but ceil(k / 128) * m for m = 5, k = "
                                  "300 needs 15"));
  EXPECT_EQ(std::count(ac.begin(), ac.end(), kPoisonCode), m * k);
  EXPECT_EQ(std::count_if(as.begin(), as.end(), [](float s) { return std::isnan(s); }), 3 * m);
}

TEST(E4m3Block, BadArgumentsNameTheCallAndTheValue) {
  const std::vector<float> w(8, 1.0f);
  Error e = testing::expect_error([&] { (void)quantize_e4m3_block128(w, 0, 8); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[quantize_e4m3_block128] n = 0 must be positive"));
  e = testing::expect_error([&] { (void)quantize_e4m3_block128(w, 2, 3); });
  EXPECT_THAT(e.what(), HasSubstr("w has 8 elements, but n * k = 2 * 3 needs 6"));
  e = testing::expect_error([&] { (void)quantize_e4m3_block128_bf16({}, 1, 0); });
  EXPECT_THAT(e.what(), HasSubstr("[quantize_e4m3_block128_bf16] k = 0 must be positive"));
  e = testing::expect_error([&] { (void)quantize_e4m3_activations({}, -1, 4); });
  EXPECT_THAT(e.what(), HasSubstr("[quantize_e4m3_activations] m = -1 must be positive"));
  const HostE4m3BlockWeights q = quantize_e4m3_block128(w, 2, 4);
  e = testing::expect_error([&] { (void)q.view().weight(2, 0); });
  EXPECT_THAT(e.what(), HasSubstr("[E4m3BlockWeightsView::weight] (2, 0) is outside the 2 x 4"));
  E4m3BlockWeightsView v = q.view();
  v.scales = {};
  e = testing::expect_error([&] { (void)dequantize(v); });
  EXPECT_THAT(e.what(), HasSubstr("[dequantize] scales has 0 elements"));
}

}  // namespace
}  // namespace metrale
