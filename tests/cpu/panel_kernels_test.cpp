// The CPU kernels over the panel layout (kGemmPanels) called directly at every instruction-set
// level, on weights packed by pack_for_panels, against the float64 reference of the SOURCE
// weights: the decode entry (the small-M kernel, or the one-weight-at-a-time path below AVX-512
// BF16, which no upload reaches since the module publishes the layout only with it) and the
// tiled entry, both formats, ragged N, K not a multiple of the 256-K panel, M across the 4-row
// passes, the 6-row tiles (16 rows: 5, 5, 6) and past 96 rows (the scaled panels' 8-row tiles),
// bias on and off, the output poisoned first with a poisoned tail.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cpu/kernels/w4a16_cpu.h"
#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/panel_pack.h"
#include "support/cpu_levels.h"
#include "support/random.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/random_weights.h"

namespace metrale::cpu::w4a16 {
namespace {

using testing::address;
using testing::random_bf16;
using testing::rng;
using testing::runnable_levels;

TEST(PanelKernels, BothEntriesAtEveryLevelMatchTheFloat64Reference) {
  constexpr std::size_t kTail = 24;  // BF16 elements after C that must stay poisoned
  struct Case {
    WeightFormat format;
    std::int64_t n, k;
  };
  for (const Case& c : {Case{WeightFormat::kNvfp4, 45, 272}, Case{WeightFormat::kNvfp4, 130, 48},
                        Case{WeightFormat::kMxfp4, 70, 288}, Case{WeightFormat::kMxfp4, 33, 96}}) {
    HostQuantWeights w = toolkit::random_weights(c.format, c.n, c.k, rng());
    if (c.format == WeightFormat::kMxfp4) w.tensor_scale = 1.5f;
    const ops::PackedPanelWeights packed = ops::pack_for_panels(w);
    for (const Isa isa : runnable_levels()) {
      for (const bool tiled : {false, true}) {
        for (const std::int64_t m : {1, 4, 5, 9, 16, 100}) {
          const bool with_bias = m % 2 == 1;
          SCOPED_TRACE(fmt::format("{} n = {} k = {} m = {} {} entry, {}", to_string(c.format), c.n,
                                   c.k, m, tiled ? "tiled" : "decode", to_string(isa)));
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
          p.flags = kGemmPanels | (c.format == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u) |
                    (with_bias ? kGemmBias : 0u);
          // Blocks as the module cuts them: 64 columns (tiled) or 256 (decode).
          const std::int64_t tile = tiled ? 64 : 256;
          for (std::int64_t n0 = 0; n0 < c.n; n0 += tile) {
            const std::int64_t n1 = std::min(c.n, n0 + tile);
            if (tiled) {
              gemm_tiled(p, n0, n1, 0, m, isa);
            } else {
              gemm_decode(p, n0, n1, isa);
            }
          }
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

}  // namespace
}  // namespace metrale::cpu::w4a16
