// INT4 weights on the host (metrale/quant.h, Note [INT4 weights]): FP16 scales converted as the
// compiler's own _Float16 converts them (every FP16 bit pattern, and random and edge floats the
// other way), the round-to-nearest quantizer's codes and error bound on fresh random data,
// W = (code − zero)·scale exact in float64 whatever the act order, act order from a g_idx,
// tensor-parallel slices, and every inconsistent field refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;

std::mt19937_64 fresh() {
  std::random_device rd;
  return std::mt19937_64((std::uint64_t{rd()} << 32) | rd());
}

// `count` draws of a standard normal.
std::vector<float> normal_values(std::mt19937_64& gen, std::int64_t count) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(static_cast<std::size_t>(count));
  for (float& x : w) x = normal(gen);
  return w;
}

TEST(Fp16, EveryPatternDecodesAsTheCompilersFloat16) {
  long bad = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    _Float16 x;
    const auto bits = static_cast<std::uint16_t>(h);
    std::memcpy(&x, &bits, 2);
    const auto want = static_cast<float>(x);
    const float got = num::f16_to_f32(bits);
    bad += std::isnan(want) ? !std::isnan(got) : std::memcmp(&want, &got, 4) != 0;
  }
  EXPECT_EQ(bad, 0);
}

TEST(Fp16, FloatsRoundToNearestEvenAsTheCompilersFloat16) {
  std::mt19937_64 gen = fresh();
  std::vector<float> values = {0.0f,     -0.0f,    65504.0f,  65519.99f, 65520.0f,        1e-8f,
                               2.98e-8f, 2.99e-8f, 6.1e-5f,   -6.1e-5f,  1.0f + 0x1p-11f, 1e30f,
                               -1e30f,   INFINITY, -INFINITY, 0x1p-25f,  0x1.8p-25f};
  for (int i = 0; i < 2'000'000; ++i) {
    const auto bits = static_cast<std::uint32_t>(gen());
    float f;
    std::memcpy(&f, &bits, 4);
    values.push_back(f);
    values.push_back(
        std::ldexp(static_cast<float>(gen() % 4096) / 2048.0f, -static_cast<int>(gen() % 30)));
  }
  long bad = 0;
  for (const float f : values) {
    const auto want16 = static_cast<_Float16>(f);
    std::uint16_t want;
    std::memcpy(&want, &want16, 2);
    const std::uint16_t got = num::f32_to_f16(f);
    bad += std::isnan(f) ? (got & 0x7C00) != 0x7C00 || (got & 0x3FF) == 0 : got != want;
  }
  EXPECT_EQ(bad, 0);
}

// Per element |w − (code − zero)·s| ≤ s/2 where w lies inside the group's range of codes, and
// codes, zero points and scales of the declared kinds.
TEST(QuantizeInt4, RoundsToNearestInEveryGroupAndScaleType) {
  std::mt19937_64 gen = fresh();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const std::int64_t group : {32, 64, 128, 256}) {
    for (const bool zp : {false, true}) {
      for (const bool fp16 : {false, true}) {
        const std::int64_t n = 5, k = 512;
        std::vector<float> w(static_cast<std::size_t>(n * k));
        for (float& x : w) x = normal(gen) * (zp ? 1.0f : 3.0f) + (zp ? 2.0f : 0.0f);
        const HostQuantWeights q = quantize_int4(w, n, k, group, zp, fp16);
        ASSERT_EQ(q.format, WeightFormat::kInt4);
        EXPECT_EQ(q.zeros.size(), zp ? static_cast<std::size_t>(n * k / group) : 0u);
        std::vector<double> exact(w.size());
        q.exact_rows(0, n, exact);
        long bad = 0;
        for (std::int64_t r = 0; r < n; ++r) {
          for (std::int64_t c = 0; c < k; ++c) {
            const double s = q.scale(r, c);
            const double err = std::fabs(w[static_cast<std::size_t>(r * k + c)] -
                                         exact[static_cast<std::size_t>(r * k + c)]);
            // The scale rounded to 8 (11) bits can put the group's extreme just past 15 codes.
            bad += err > 0.5 * s * (1.0 + (fp16 ? 0x1p-10 : 0x1p-7) * 16);
            bad += q.code(r, c) > 15;
          }
        }
        EXPECT_EQ(bad, 0) << "group " << group << (zp ? " asym" : " sym")
                          << (fp16 ? " fp16" : " bf16");
      }
    }
  }
}

TEST(Int4Weights, ActOrderKeepsEveryWeight) {
  std::mt19937_64 gen = fresh();
  const std::int64_t n = 3, k = 256, group = 64;
  const std::vector<float> w = normal_values(gen, n * k);
  const HostQuantWeights q = quantize_int4(w, n, k, group, true, false);
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < k; ++i)
    g_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i / group);
  EXPECT_TRUE(with_act_order(q, g_idx).k_perm.empty()) << "k / group is no permutation";
  std::shuffle(g_idx.begin(), g_idx.end(), gen);
  const HostQuantWeights a = with_act_order(q, g_idx);
  ASSERT_EQ(a.k_perm.size(), static_cast<std::size_t>(k));
  for (std::int64_t j = 0; j < k; ++j) {
    EXPECT_EQ(g_idx[static_cast<std::size_t>(a.k_perm[static_cast<std::size_t>(j)])], j / group);
  }
  // W[r, c] = (code[r, c] − zero of c's group)·scale of it, where c's group is now g_idx[c].
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t c = 0; c < k; ++c) {
      const std::int64_t g = g_idx[static_cast<std::size_t>(c)];
      const double want = (q.code(r, c) - q.zeros[static_cast<std::size_t>(r * (k / group) + g)]) *
                          static_cast<double>(q.scale(r, g * group));
      EXPECT_EQ(a.exact_weight(r, c), want);
      EXPECT_EQ(a.code(r, c), q.code(r, c));
    }
  }
  // Groups that do not hold `group` columns each, or indices outside the groups.
  g_idx[0] = g_idx[0] == 0 ? 1 : 0;
  EXPECT_THAT(testing::expect_error([&] { (void)with_act_order(q, g_idx); }).what(),
              HasSubstr("columns in group"));
  g_idx[0] = 4;
  EXPECT_THAT(testing::expect_error([&] { (void)with_act_order(q, g_idx); }).what(),
              HasSubstr("g_idx[0] = 4 is outside the 4 groups"));
}

TEST(Int4Weights, SlicesKeepTheirPartOfW) {
  std::mt19937_64 gen = fresh();
  const std::int64_t n = 6, k = 256;
  const std::vector<float> w = normal_values(gen, n * k);
  for (const std::int64_t group : {std::int64_t{64}, k}) {
    const HostQuantWeights q = quantize_int4(w, n, k, group, true, true);
    const HostQuantWeights rows = slice_rows(q, 2, 5);
    const std::int64_t c0 = group == k ? 2 : 64, c1 = group == k ? 130 : 192;
    const HostQuantWeights cols = slice_columns(q, c0, c1);
    EXPECT_EQ(cols.group, group == k ? c1 - c0 : group);
    for (std::int64_t r = 0; r < 3; ++r) {
      for (std::int64_t c = 0; c < k; ++c)
        EXPECT_EQ(rows.exact_weight(r, c), q.exact_weight(r + 2, c));
    }
    for (std::int64_t r = 0; r < n; ++r) {
      for (std::int64_t c = c0; c < c1; ++c)
        EXPECT_EQ(cols.exact_weight(r, c - c0), q.exact_weight(r, c));
    }
    EXPECT_THAT(testing::expect_error([&] { (void)slice_columns(q, 1, 3 + 64); }).what(),
                HasSubstr("at multiples of"));
  }
  HostQuantWeights act = quantize_int4(w, n, k, 64, false, false);
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < k; ++i)
    g_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((k - 1 - i) / 64);
  act = with_act_order(act, g_idx);
  EXPECT_EQ(slice_rows(act, 1, 2).k_perm, act.k_perm);
}

// A K slice of act-ordered weights (Note [Act order across ranks]): W's columns [c0, c1) and
// nothing else, in groups of 32 whose padding columns hold the zero point, A's columns those of
// the slice; every split of K into 2 and 4 ranks, groups of 32, 64 and 128, with and without
// zero points, g_idx a fresh random assignment.
TEST(Int4Weights, ActOrderedKSlicesHoldTheirColumnsInPaddedGroupsOf32) {
  std::mt19937_64 gen = fresh();
  const std::int64_t n = 5, k = 512;
  const std::vector<float> w = normal_values(gen, n * k);
  for (const std::int64_t group : {32, 64, 128}) {
    for (const bool zeros : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "group " << group << (zeros ? ", zero points" : ""));
      std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
      for (std::int64_t i = 0; i < k; ++i)
        g_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i / group);
      std::shuffle(g_idx.begin(), g_idx.end(), gen);
      const HostQuantWeights act =
          with_act_order(quantize_int4(w, n, k, group, zeros, true), g_idx);
      for (const std::int64_t ranks : {2, 4}) {
        for (std::int64_t r = 0; r < ranks; ++r) {
          const std::int64_t c0 = r * k / ranks, c1 = (r + 1) * k / ranks;
          const HostQuantWeights s = slice_columns(act, c0, c1);
          ASSERT_EQ(a_columns(s), c1 - c0);
          EXPECT_EQ(s.group, 32);
          EXPECT_EQ(s.k % 32, 0);
          EXPECT_GE(s.k, c1 - c0);
          EXPECT_EQ(s.zeros.empty(), !zeros);
          for (std::int64_t row = 0; row < n; ++row) {
            for (std::int64_t c = c0; c < c1; ++c)
              ASSERT_EQ(s.exact_weight(row, c - c0), act.exact_weight(row, c)) << row << ", " << c;
          }
          // The padding: -1 in k_perm, and weights of exactly 0 there.
          std::vector<double> stored(static_cast<std::size_t>(s.k));
          std::int64_t padding = 0;
          for (std::int64_t j = 0; j < s.k; ++j) {
            if (s.k_perm[static_cast<std::size_t>(j)] != -1) continue;
            ++padding;
            const int zero = zeros ? s.zeros[static_cast<std::size_t>(j / 32)] : 8;
            const std::uint8_t byte = s.codes[static_cast<std::size_t>(j / 2)];
            EXPECT_EQ((j & 1) ? byte >> 4 : byte & 0xF, zero) << j;
          }
          EXPECT_EQ(padding, s.k - (c1 - c0));
          // A slice whose groups' runs all fill whole blocks has no padding (about 1 run in 100
          // draws one): it is a whole layer's weights of K = c1 - c0, and slices as one
          // (AnActOrderedSliceWithoutPaddingSlicesAgain).
          if (padding > 0) {
            EXPECT_THAT(testing::expect_error([&] { (void)slice_columns(s, 0, 32); }).what(),
                        HasSubstr("a K slice already"));
          }
        }
      }
    }
  }
}

// A K slice that needs no padding (each group's run fills whole blocks of 32) holds the
// slice's columns as a whole layer's act-ordered weights do, so slicing it again takes the
// columns of the first slice's range; one with padding is refused, as above.
TEST(Int4Weights, AnActOrderedSliceWithoutPaddingSlicesAgain) {
  std::mt19937_64 gen = fresh();
  const std::int64_t n = 3, k = 512, group = 128;
  const std::vector<float> w = normal_values(gen, n * k);
  // Groups in reverse: columns [0, 128) are group 3, stored last; [128, 256) group 2.
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < k; ++i)
    g_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((k - 1 - i) / group);
  const HostQuantWeights act = with_act_order(quantize_int4(w, n, k, group, true, false), g_idx);
  const HostQuantWeights s = slice_columns(act, 128, 256);
  ASSERT_EQ(s.k, 128);
  ASSERT_EQ(a_columns(s), 128);
  const HostQuantWeights again = slice_columns(s, 32, 96);
  ASSERT_EQ(a_columns(again), 64);
  for (std::int64_t row = 0; row < n; ++row) {
    for (std::int64_t c = 0; c < 64; ++c)
      ASSERT_EQ(again.exact_weight(row, c), act.exact_weight(row, 128 + 32 + c))
          << row << ", " << c;
  }
}

TEST(Int4Weights, InconsistentFieldsAreRefusedByName) {
  const HostQuantWeights good =
      quantize_int4(std::vector<float>(4 * 128, 0.5f), 4, 128, 32, true, false);
  const auto refusal = [](HostQuantWeights w) {
    return std::string(testing::expect_error([&] { (void)dequantize(w); }).what());
  };
  HostQuantWeights w = good;
  w.group = 48;
  EXPECT_THAT(refusal(w), HasSubstr("int4 group 48 for K = 128"));
  w = good;
  w.zeros[5] = 16;
  EXPECT_THAT(refusal(w), HasSubstr("zero point [1, 1] is 16"));
  w = good;
  w.zeros.pop_back();
  EXPECT_THAT(refusal(w), HasSubstr("zero points are 15 bytes"));
  w = good;
  w.k_perm.assign(128, 0);
  EXPECT_THAT(refusal(w), HasSubstr("k_perm[1] = 0 is repeated"));
  // -1 marks padding; the other entries must then be a permutation of [0, their count).
  std::iota(w.k_perm.begin(), w.k_perm.end(), 0);
  w.k_perm[5] = -1;
  EXPECT_THAT(refusal(w), HasSubstr("k_perm[127] = 127 is outside A's columns"));
  w.k_perm[127] = 5;
  EXPECT_EQ(a_columns(w), 127);
  EXPECT_EQ(dequantize(w).size(), 4u * 127u);
  w.k_perm[7] = -2;
  EXPECT_THAT(refusal(w), HasSubstr("k_perm[7] = -2 is outside A's columns"));
  w.k_perm.assign(128, -1);
  EXPECT_THAT(refusal(w), HasSubstr("no column of W"));
  w = good;
  w.scales.pop_back();
  EXPECT_THAT(refusal(w), HasSubstr("need 256 code bytes and 32 scale bytes"));
  w = good;
  w.tensor_scale = 2.0f;
  EXPECT_THAT(refusal(w), HasSubstr("no tensor scale"));
  w = good;
  w.layout = WeightLayout::kTransposed;
  EXPECT_THAT(refusal(w), HasSubstr("row-major only"));
  EXPECT_THAT(
      testing::expect_error([&] { (void)with_layout(good, WeightLayout::kTransposed); }).what(),
      HasSubstr("row-major only"));
  EXPECT_THAT(testing::expect_error([&] {
                (void)quantize_int4(std::vector<float>(4 * 96, 0.0f), 4, 96, 64, false, false);
              }).what(),
              HasSubstr("group 64 for K = 96"));
}

}  // namespace
}  // namespace metrale
