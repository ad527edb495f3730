// The CPU twin of gemm_decode_packed (cpu/kernels/decode_packed_cpu.h) on weights packed by
// pack_for_decode, against the float64 reference of the SOURCE weights (toolkit/gemm_reference.h:
// HostQuantWeights' codes and scales): both formats and source layouts, ragged N and K, M = 1, 5,
// 16 and 17, bias on and off, a tensor scale other than 1, the output poisoned first.
#include "cpu/kernels/decode_packed_cpu.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/decode_pack.h"
#include "support/random.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/random_weights.h"

namespace metrale::cpu::w4a16 {
namespace {

using testing::address;
using testing::random_bf16;
using testing::rng;

struct Case {
  WeightFormat format;
  std::int64_t n, k;
};

TEST(DecodePackedCpu, MatchesTheFloat64ReferenceOfTheSourceWeights) {
  constexpr std::size_t kTail = 24;  // BF16 elements after C that must stay poisoned
  const std::vector<Case> cases = {
      {WeightFormat::kNvfp4, 45, 160}, {WeightFormat::kNvfp4, 64, 256},
      {WeightFormat::kNvfp4, 7, 48},   {WeightFormat::kNvfp4, 97, 400},
      {WeightFormat::kMxfp4, 45, 160}, {WeightFormat::kMxfp4, 64, 256},
      {WeightFormat::kMxfp4, 7, 96},   {WeightFormat::kMxfp4, 97, 416},
  };
  for (const Case& c : cases) {
    HostQuantWeights w = toolkit::random_weights(c.format, c.n, c.k, rng());
    // MXFP4 has no tensor scale of its own; the kernel's is tested with one anyway.
    if (c.format == WeightFormat::kMxfp4) w.tensor_scale = 1.5f;
    for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      const ops::PackedDecodeWeights packed = ops::pack_for_decode(with_layout(w, layout));
      for (const std::int64_t m : {1, 5, 16, 17}) {
        for (const bool with_bias : {false, true}) {
          SCOPED_TRACE(fmt::format(
              "{} n = {} k = {} m = {} {} bias {}", to_string(c.format), c.n, c.k, m,
              layout == WeightLayout::kRowMajor ? "row-major" : "transposed", with_bias));
          const std::vector<std::uint16_t> a = random_bf16(static_cast<std::size_t>(m * c.k));
          const std::vector<std::uint16_t> bias =
              with_bias ? random_bf16(static_cast<std::size_t>(c.n)) : std::vector<std::uint16_t>{};
          std::vector<std::uint16_t> out(static_cast<std::size_t>(m * c.n) + kTail,
                                         toolkit::kPoisonBf16);
          GemmParams p;
          p.a = address(a.data());
          p.codes = address(packed.codes.data());
          p.scales = address(packed.scales.data());
          p.out = address(out.data());
          p.bias = with_bias ? address(bias.data()) : 0;
          p.m = m;
          p.n = c.n;
          p.k = c.k;
          p.tensor_scale = packed.tensor_scale;
          p.weight_fold = packed.fold;
          p.flags = kGemmDecodePacked | (c.format == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u) |
                    (with_bias ? kGemmBias : 0u);
          // Two blocks split inside a tile, as the CPU launch may cut the columns.
          const std::int64_t cut = c.n / 2 + 1;
          gemm_decode_packed(p, 0, cut);
          gemm_decode_packed(p, cut, c.n);
          const toolkit::Reference ref = toolkit::reference(a, m, w, bias, toolkit::AMode::kBf16);
          const toolkit::Comparison cmp =
              toolkit::compare(std::span(out.data(), static_cast<std::size_t>(m * c.n)), ref);
          EXPECT_TRUE(toolkit::within(cmp, toolkit::kNormTol)) << cmp.str();
          for (std::size_t i = 0; i < kTail; ++i) {
            ASSERT_EQ(out[static_cast<std::size_t>(m * c.n) + i], toolkit::kPoisonBf16)
                << "element " << i << " past C was written";
          }
        }
      }
    }
  }
}

TEST(DecodePackedCpu, WritesOnlyItsColumns) {
  const HostQuantWeights w = toolkit::random_weights(WeightFormat::kNvfp4, 70, 144, rng());
  const ops::PackedDecodeWeights packed = ops::pack_for_decode(w);
  const std::int64_t m = 3;
  const std::vector<std::uint16_t> a = random_bf16(static_cast<std::size_t>(m * w.k));
  std::vector<std::uint16_t> out(static_cast<std::size_t>(m * w.n), toolkit::kPoisonBf16);
  GemmParams p;
  p.a = address(a.data());
  p.codes = address(packed.codes.data());
  p.scales = address(packed.scales.data());
  p.out = address(out.data());
  p.m = m;
  p.n = w.n;
  p.k = w.k;
  p.tensor_scale = w.tensor_scale;
  p.weight_fold = packed.fold;
  p.flags = kGemmDecodePacked;
  gemm_decode_packed(p, 20, 45);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < w.n; ++j) {
      const bool mine = j >= 20 && j < 45;
      EXPECT_EQ(out[i * w.n + j] != toolkit::kPoisonBf16, mine) << "C[" << i << ", " << j << "]";
    }
  }
}

}  // namespace
}  // namespace metrale::cpu::w4a16
