// The CPU backend's block-scaled FP8 dense GEMM (DenseKind::kE4m3Block128) through
// Backend::plan_dense_gemm / run_dense_gemm, against a float64 reference of the same codes and
// scales in dense_gemm.h's padded layouts, with the output poisoned first; ragged N and K (the
// tail blocks of both scale grids), M and ceil(K/128) off multiples of 4 (padded scale rows),
// and padding entries of NaN that must never be read.
//
// THE BOUND (per element, deterministic). Every product of two E4M3 values is exact in FP32
// (4 × 4 significant bits; exponents from 2^-18 to 2^17.6). The kernel then rounds: the additions
// inside each 128-K block (at most 127), the two scale products of each block sum, the additions
// across the ceil(K/128) blocks and the bias addition: n ≤ K + 2·ceil(K/128) + 1 FP32 roundings
// on any path, so |v − ref| ≤ γ_n·S with S = Σ_k |a·sa·b·sb| + |bias| and γ_n ≈ n·2^-24 (we allow
// 2^-23, as the toolkit's table does, for slack). The final rounding to BF16 adds at most 2^-8
// of the value: |out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·(K + 2·ceil(K/128) + 8)·2^-23·S.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::rng;

constexpr std::uint16_t kPoison = 0x7FC1;  // a BF16 NaN no GEMM writes

std::vector<std::uint8_t> random_e4m3(std::size_t count) {
  std::uniform_int_distribution<int> u(0, 255);
  std::vector<std::uint8_t> v(count);
  for (auto& x : v) {
    do x = static_cast<std::uint8_t>(u(rng()));
    // Not NaN, and not ±0: a 1 x 1 x 1 case of zero codes would leave the reference all zero
    // and the normalized check without a norm (it failed that way once in 128 draws).
    while ((x & 0x7F) == 0x7F || (x & 0x7F) == 0);
  }
  return v;
}

std::vector<float> random_scales(std::size_t count) {
  std::uniform_real_distribution<float> u(0.25f, 4.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = u(rng()) / 448.0f;
  return v;
}

double element_bound(double ref, double abs_sum, std::int64_t k) {
  const double n = static_cast<double>(k + 2 * ((k + 127) / 128) + 8);
  return std::ldexp(std::fabs(ref), -8) +
         (1.0 + std::ldexp(1.0, -8)) * n * std::ldexp(abs_sum, -23);
}

struct Case {
  std::int64_t m, n, k;
};

// Random scales in the padded layouts of dense_gemm.h (lda = round_up(M, 4) per K block, ldb =
// round_up(ceil(K/128), 4) per N block), every padding entry set to pad.
std::vector<float> padded_scales(std::int64_t rows, std::int64_t cols, std::int64_t ld, float pad) {
  std::vector<float> v = random_scales(static_cast<std::size_t>(rows * ld));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = cols; c < ld; ++c) v[static_cast<std::size_t>(r * ld + c)] = pad;
  return v;
}

// One GEMM of s through plan / run with C poisoned, checked per element and normalized against
// float64; the scales' padding entries hold pad.
void check_case(CpuBackend& be, const Case s, bool with_bias, float pad) {
  SCOPED_TRACE(::testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k
                                    << " bias=" << with_bias << " pad=" << pad);
  const DenseGemmShape shape{DenseKind::kE4m3Block128, s.m, s.n, s.k, with_bias};
  const DenseGemmBytes bytes = dense_gemm_bytes("test", shape);
  const std::int64_t kb = (s.k + 127) / 128, nb = (s.n + 127) / 128;
  const std::int64_t lda = (s.m + 3) / 4 * 4, ldb = (kb + 3) / 4 * 4;
  const auto ha = random_e4m3(static_cast<std::size_t>(s.m * s.k)),
             hb = random_e4m3(static_cast<std::size_t>(s.n * s.k));
  const auto hsa = padded_scales(kb, s.m, lda, pad), hsb = padded_scales(nb, kb, ldb, pad);
  ASSERT_EQ(hsa.size() * 4, bytes.a_scales);
  ASSERT_EQ(hsb.size() * 4, bytes.b_scales);
  std::vector<std::uint16_t> hbias(static_cast<std::size_t>(s.n));
  for (auto& x : hbias) x = num::f32_to_bf16(std::uniform_real_distribution<float>(-1, 1)(rng()));

  DenseGemmArgs args;
  args.a = be.alloc(bytes.a);
  args.b = be.alloc(bytes.b);
  args.c = be.alloc(bytes.c);
  args.a_scales = be.alloc(bytes.a_scales);
  args.b_scales = be.alloc(bytes.b_scales);
  if (with_bias) args.bias = be.alloc(bytes.bias);
  be.copy_h2d(args.a, ha.data(), ha.size());
  be.copy_h2d(args.b, hb.data(), hb.size());
  be.copy_h2d(args.a_scales, hsa.data(), bytes.a_scales);
  be.copy_h2d(args.b_scales, hsb.data(), bytes.b_scales);
  if (with_bias) be.copy_h2d(args.bias, hbias.data(), bytes.bias);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(s.m * s.n), kPoison);
  be.copy_h2d(args.c, out.data(), bytes.c);

  const DenseGemmPlan plan = be.plan_dense_gemm(shape);
  EXPECT_EQ(plan.workspace_bytes, 0u);
  be.run_dense_gemm(plan, args, be.default_stream());
  be.copy_d2h(out.data(), args.c, bytes.c);

  double err2 = 0, ref2 = 0;
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      double ref = with_bias ? num::bf16_to_f32(hbias[static_cast<std::size_t>(j)]) : 0.0;
      double abs_sum = std::fabs(ref);
      for (std::int64_t q = 0; q < s.k; ++q) {
        const double scale =
            static_cast<double>(hsa[static_cast<std::size_t>((q / 128) * lda + i)]) *
            hsb[static_cast<std::size_t>((j / 128) * ldb + q / 128)];
        const double p =
            static_cast<double>(num::e4m3_to_f32(ha[static_cast<std::size_t>(i * s.k + q)])) *
            num::e4m3_to_f32(hb[static_cast<std::size_t>(j * s.k + q)]) * scale;
        ref += p;
        abs_sum += std::fabs(p);
      }
      const std::uint16_t got_bits = out[static_cast<std::size_t>(i * s.n + j)];
      ASSERT_NE(got_bits, kPoison) << "C[" << i << ", " << j << "] was not written";
      const double got = num::bf16_to_f32(got_bits);
      ASSERT_TRUE(std::isfinite(got)) << "C[" << i << ", " << j << "] = " << got;
      ASSERT_LE(std::fabs(got - ref), element_bound(ref, abs_sum, s.k))
          << "C[" << i << ", " << j << "] = " << got << ", reference " << ref;
      err2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
    }
  }
  ASSERT_GT(ref2, 0.0);
  EXPECT_LE(std::sqrt(err2 / ref2), 8e-3);  // the output rounding (2^-8) and the sums
  for (DevicePtr p : {args.a, args.b, args.c, args.a_scales, args.b_scales, args.bias}) {
    if (p) be.free(p);
  }
}

TEST(CpuDenseE4m3, Block128MatchesTheFloat64Reference) {
  CpuBackend be;
  EXPECT_EQ(be.dense_gemm_unavailable(DenseKind::kE4m3Block128), "");
  // M % 4 != 0 and ceil(K/128) % 4 != 0 (padded scale rows) next to shapes with no padding.
  for (const Case s : {Case{1, 1, 1}, Case{3, 70, 37}, Case{5, 129, 256}, Case{17, 300, 300},
                       Case{64, 200, 128}, Case{4, 130, 512}, Case{6, 40, 700}}) {
    for (const bool with_bias : {false, true}) {
      // Finite padding far from any scale: a read of it shows as a wrong number.
      check_case(be, s, with_bias, 1024.0f);
    }
  }
}

TEST(CpuDenseE4m3, ThePaddingOfTheScalesIsNeverRead) {
  CpuBackend be;
  // NaN in every padding entry: one read of it would make an output NaN.
  for (const Case s : {Case{1, 300, 200}, Case{5, 129, 300}, Case{2, 3, 1100}, Case{17, 97, 300}})
    check_case(be, s, /*with_bias=*/false, std::nanf(""));
}

TEST(CpuDenseE4m3, ScaleBytesAreThePaddedLayouts) {
  // M = 1 → lda 4; K = 200 → 2 K blocks → ldb 4; N = 300 → 3 N blocks.
  const DenseGemmBytes b =
      dense_gemm_bytes("test", DenseGemmShape{DenseKind::kE4m3Block128, 1, 300, 200});
  EXPECT_EQ(b.a_scales, 2u * 4u * 4u);
  EXPECT_EQ(b.b_scales, 3u * 4u * 4u);
  const DenseGemmBytes c =
      dense_gemm_bytes("test", DenseGemmShape{DenseKind::kE4m3Block128, 8, 128, 512});
  EXPECT_EQ(c.a_scales, 4u * 8u * 4u);  // no padding: M and ceil(K/128) multiples of 4
  EXPECT_EQ(c.b_scales, 1u * 4u * 4u);
  static_assert(dense_a_scales_ld(1) == 4 && dense_a_scales_ld(4) == 4 &&
                dense_a_scales_ld(5) == 8);
  static_assert(dense_b_scales_ld(1) == 4 && dense_b_scales_ld(512) == 4 &&
                dense_b_scales_ld(513) == 8);
}

TEST(CpuDenseE4m3, RefusesMissingScales) {
  CpuBackend be;
  const DenseGemmShape shape{DenseKind::kE4m3Block128, 2, 8, 16};
  const DenseGemmBytes bytes = dense_gemm_bytes("test", shape);
  DenseGemmArgs args;
  args.a = be.alloc(bytes.a);
  args.b = be.alloc(bytes.b);
  args.c = be.alloc(bytes.c);
  args.a_scales = be.alloc(bytes.a_scales);
  const DenseGemmPlan plan = be.plan_dense_gemm(shape);
  try {
    be.run_dense_gemm(plan, args, be.default_stream());
    ADD_FAILURE() << "no error for null B scales";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("B's scales is null"), std::string::npos) << e.what();
  }
  for (DevicePtr p : {args.a, args.b, args.c, args.a_scales}) be.free(p);
}

}  // namespace
}  // namespace metrale
