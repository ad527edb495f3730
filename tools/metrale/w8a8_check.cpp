#include "w8a8_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "metrale/backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/fp8_requant.h"
#include "metrale/quant.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/w8a8_reference.h"

namespace metrale::cli {
namespace {

std::int64_t blocks(std::int64_t v) {
  return (v + 127) / 128;
}

// The block scale rule of the op's cast, restated: amax / 448, 1 for an all-zero block.
float scale_of(float amax) {
  return amax == 0.0f ? 1.0f : amax / 448.0f;
}

// A GPU's FP8 tensor cores: the numerics suite's allowance per unit of S8
// (tests/ops/fp8_gemm_test.cpp); the CPU reference accumulates in FP32.
double mma_term(const Backend& b) {
  return b.name() == "cpu" ? 0.0 : 2 * toolkit::kFp8MmaTerm;
}

}  // namespace

bool has_w8a8(ModelScope& scope) {
  return scope.backend().dense_gemm_unavailable(DenseKind::kE4m3Block128).empty();
}

std::string check_w8a8(ModelScope& scope, std::mt19937_64& rng, bool bias) {
  Backend& b = scope.backend();
  // N a multiple of 8 and K of 16: cuBLASLt's FP8 rules for a BF16 D (docs/CONTRACT.md, dense
  // GEMMs), so the same draw runs on every backend; partial 128-blocks stay likely.
  std::uniform_int_distribution<std::int64_t> pick_m(1, 300), pick_n(1, 37), pick_k(1, 25);
  const std::int64_t m = pick_m(rng), n = 8 * pick_n(rng), k = 16 * pick_k(rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Weights: E4M3 codes with one scale per 128 x 128 block (amax / 448).
  std::vector<float> wf(static_cast<std::size_t>(n * k));
  for (float& x : wf) x = normal(rng);
  std::vector<std::uint8_t> codes(wf.size());
  std::vector<float> scales(static_cast<std::size_t>(blocks(n) * blocks(k)));
  for (std::int64_t bn = 0; bn < blocks(n); ++bn) {
    for (std::int64_t bk = 0; bk < blocks(k); ++bk) {
      float amax = 0.0f;
      for (std::int64_t r = bn * 128; r < std::min(n, bn * 128 + 128); ++r)
        for (std::int64_t c = bk * 128; c < std::min(k, bk * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(wf[static_cast<std::size_t>(r * k + c)]));
      const float s = scale_of(amax);
      scales[static_cast<std::size_t>(bn * blocks(k) + bk)] = s;
      for (std::int64_t r = bn * 128; r < std::min(n, bn * 128 + 128); ++r)
        for (std::int64_t c = bk * 128; c < std::min(k, bk * 128 + 128); ++c)
          codes[static_cast<std::size_t>(r * k + c)] =
              num::f32_to_e4m3(wf[static_cast<std::size_t>(r * k + c)] / s);
    }
  }
  std::vector<std::uint8_t> scale_bytes(scales.size() * 4);
  std::memcpy(scale_bytes.data(), scales.data(), scale_bytes.size());
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k)), hb(static_cast<std::size_t>(n));
  for (auto& x : a) x = num::f32_to_bf16(normal(rng));
  for (auto& x : hb) x = num::f32_to_bf16(normal(rng));

  // Owned by the scope, so a plan or run that throws leaves nothing behind at teardown.
  const ops::Fp8Weights& w =
      scope.add(std::make_unique<ops::Fp8WeightsResource>(b, codes, scale_bytes, n, k)).weights();
  const DevicePtr da = scope.alloc_buffer("w8a8 A", a.size() * 2);
  const DevicePtr dc = scope.alloc_buffer("w8a8 C", static_cast<std::size_t>(m * n) * 2);
  const DevicePtr dbias = scope.alloc_buffer("w8a8 bias", hb.size() * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  b.copy_h2d(dbias, hb.data(), hb.size() * 2);
  b.memset(dc, 0xFF, static_cast<std::size_t>(m * n) * 2);  // NaN: an unwritten element fails
  const ops::Fp8GemmPlan plan = ops::plan(b, m, w, ops::Fp8GemmOptions{bias ? dbias : DevicePtr{}});
  ops::run(plan, b.default_stream(), da, w, dc, ops::scratch_workspace(plan, b.default_stream()),
           bias ? dbias : DevicePtr{});
  std::vector<std::uint16_t> c(static_cast<std::size_t>(m * n));
  b.copy_d2h(c.data(), dc, c.size() * 2);

  // A cast as the op casts it, in float64 values.
  std::vector<double> a8(a.size());
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t bk = 0; bk < blocks(k); ++bk) {
      const std::int64_t k0 = bk * 128, k1 = std::min(k, k0 + 128);
      float amax = 0.0f;
      for (std::int64_t q = k0; q < k1; ++q)
        amax = std::max(amax, std::fabs(num::bf16_to_f32(a[static_cast<std::size_t>(i * k + q)])));
      const float s = scale_of(amax);
      for (std::int64_t q = k0; q < k1; ++q) {
        const auto at = static_cast<std::size_t>(i * k + q);
        a8[at] =
            static_cast<double>(num::e4m3_to_f32(num::f32_to_e4m3(num::bf16_to_f32(a[at]) / s))) *
            s;
      }
    }
  }
  const double gamma =
      static_cast<double>(k + 2 * blocks(k) + 8) * std::ldexp(1.0, -23) + mma_term(b);
  const double u8 = std::ldexp(1.0, -8);
  double worst = 0, err2 = 0, ref2 = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double ref = bias ? num::bf16_to_f32(hb[static_cast<std::size_t>(j)]) : 0.0;
      double s8 = std::fabs(ref);
      for (std::int64_t q = 0; q < k; ++q) {
        const double wd =
            static_cast<double>(num::e4m3_to_f32(codes[static_cast<std::size_t>(j * k + q)])) *
            scales[static_cast<std::size_t>((j / 128) * blocks(k) + q / 128)];
        const double p = a8[static_cast<std::size_t>(i * k + q)] * wd;
        ref += p;
        s8 += std::fabs(p);
      }
      const double got = num::bf16_to_f32(c[static_cast<std::size_t>(i * n + j)]);
      const double bound = u8 * std::fabs(ref) + (1 + u8) * gamma * s8;
      const double ratio = std::fabs(got - ref) / bound;
      if (!(ratio <= 1.0)) {
        throw Error(ErrorCode::kInternal, "check",
                    fmt::format("M={} N={} K={}: C[{}, {}] = {}, reference {} (bound {:.3g})", m, n,
                                k, i, j, got, ref, bound));
      }
      worst = std::max(worst, ratio);
      err2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
    }
  }
  return fmt::format("normalized error {:.3g}, worst element at {:.2f} of its bound; plan {}",
                     ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0, worst, plan.describe());
}

std::string check_w8a8_requantized(ModelScope& scope, std::mt19937_64& rng, WeightFormat format) {
  Backend& b = scope.backend();
  const std::int64_t group = group_size(format);
  // N a multiple of 8 (K is one of 16 already): cuBLASLt's FP8 rules, as above.
  std::uniform_int_distribution<std::int64_t> pick_m(1, 64), pick_n(1, 25), pick_g(1, 512 / group);
  const std::int64_t m = pick_m(rng), n = 8 * pick_n(rng), k = pick_g(rng) * group;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> wf(static_cast<std::size_t>(n * k));
  for (float& x : wf) x = normal(rng);
  const HostQuantWeights hw =
      format == WeightFormat::kNvfp4 ? quantize_nvfp4(wf, n, k) : quantize_mxfp4(wf, n, k);
  const HostE4m3BlockWeights wq = requantize_e4m3_block128(hw);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
  for (auto& x : a) x = num::f32_to_bf16(normal(rng));

  const ops::Fp8Weights& w = scope.add(ops::make_requantized_fp8_resource(b, hw)).weights();
  const DevicePtr da = scope.alloc_buffer("w8a8 A", a.size() * 2);
  const DevicePtr dc = scope.alloc_buffer("w8a8 C", static_cast<std::size_t>(m * n) * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  b.memset(dc, 0xFF, static_cast<std::size_t>(m * n) * 2);  // NaN: an unwritten element fails
  const ops::Fp8GemmPlan plan = ops::plan(b, m, w, {});
  ops::run(plan, b.default_stream(), da, w, dc, ops::scratch_workspace(plan, b.default_stream()));
  std::vector<std::uint16_t> c(static_cast<std::size_t>(m * n));
  b.copy_d2h(c.data(), dc, c.size() * 2);

  // Every element around the float64 product with the 4-bit weights (toolkit/w8a8_reference.h),
  // and the norm against what the op computes (A and W as cast).
  double worst = 0, err2 = 0, ref2 = 0;
  for (std::int64_t i = 0; i < m; ++i) {
    const std::span<const std::uint16_t> row(a.data() + i * k, static_cast<std::size_t>(k));
    const toolkit::CastRow a8 = toolkit::cast_row(row);
    for (std::int64_t j = 0; j < n; ++j) {
      const toolkit::W8a8Element ref =
          toolkit::w8a8_reference_element(a8, row, wq.view(), j, 0.0, mma_term(b), &hw);
      const double got = num::bf16_to_f32(c[static_cast<std::size_t>(i * n + j)]);
      const double ratio = std::fabs(got - ref.value) / ref.bound;
      if (!(ratio <= 1.0)) {
        throw Error(ErrorCode::kInternal, "check",
                    fmt::format("M={} N={} K={}: C[{}, {}] = {}, reference {} (bound {:.3g})", m, n,
                                k, i, j, got, ref.value, ref.bound));
      }
      worst = std::max(worst, ratio);
      err2 += (got - ref.aware) * (got - ref.aware);
      ref2 += ref.aware * ref.aware;
    }
  }
  const double norm = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  if (!(norm <= toolkit::kNormTol)) {
    throw Error(ErrorCode::kInternal, "check",
                fmt::format("M={} N={} K={}: normalized error {:.3g} against the cast operands "
                            "(tolerance {:.1g})",
                            m, n, k, norm, toolkit::kNormTol));
  }
  return fmt::format(
      "normalized error {:.3g} (cast operands), worst element at {:.2f} of its bound (4-bit "
      "weights); plan {}",
      norm, worst, plan.describe());
}

}  // namespace metrale::cli
