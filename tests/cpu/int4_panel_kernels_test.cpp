// The CPU kernels over INT4 weights in the panel layout (kGemmInt4 | kGemmPanels) called directly
// at every instruction-set level, on codes packed by pack_int4_codes_for_panels and the source
// layout's side buffer, against the float64 reference of the source weights: the decode and tiled
// entries (AVX-512 BF16: the tiles that decode the lines themselves, and on the tiled entry past 16
// rows the panels decoded once per block; below it the portable kernel, which no upload reaches
// since the module publishes the layout only with AVX-512 BF16), groups of 32, 64, 128, 256 and
// one scale per row, with and without zero points, ragged N, the output poisoned first with a
// poisoned tail.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/kernels/w4a16_cpu.h"
#include "kernels/gemm_params.h"
#include "kernels/int4_layout.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "ops/int4_cases.h"
#include "ops/panel_pack.h"
#include "support/cpu_levels.h"
#include "support/random.h"

namespace metrale::cpu::w4a16 {
namespace {

using testing::address;
using testing::runnable_levels;

TEST(Int4PanelKernels, BothEntriesAtEveryLevelMatchTheFloat64Reference) {
  constexpr std::size_t kTail = 24;  // BF16 elements after C that must stay poisoned
  const std::uint64_t seed = testing::gemm::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  struct Shape {
    std::int64_t n, k, group;
  };
  // Blocks of 32, 64 and 128 K; a group spanning two 128-K blocks; one scale per row of 96 K.
  for (const Shape& s : {Shape{45, 288, 32}, Shape{40, 448, 64}, Shape{70, 384, 128},
                         Shape{36, 768, 256}, Shape{33, 96, 96}}) {
    for (const bool zp : {false, true}) {
      testing::gemm::Int4Case c;
      c.n = s.n;
      c.k = s.k;
      c.group = s.group;
      c.zero_points = zp;
      c.fp16 = zp;
      const HostQuantWeights w = testing::gemm::random_int4(gen, c);
      const std::vector<std::uint8_t> codes = ops::pack_int4_codes_for_panels(w);
      const std::vector<std::uint8_t> side = ops::pack_int4_side(w, true);
      for (const Isa isa : runnable_levels()) {
        for (const bool tiled : {false, true}) {
          for (const std::int64_t m : {1, 5, 16, 100}) {
            SCOPED_TRACE(fmt::format("n = {} k = {} group {}{} m = {} {} entry, {}", s.n, s.k,
                                     s.group, zp ? " zero points" : "", m,
                                     tiled ? "tiled" : "decode", to_string(isa)));
            const std::vector<std::uint16_t> a =
                testing::gemm::random_activations(gen, static_cast<std::size_t>(m * s.k));
            std::vector<std::uint16_t> out(static_cast<std::size_t>(m * s.n) + kTail,
                                           toolkit::kPoisonBf16);
            GemmParams p;
            p.a = address(a.data());
            p.codes = address(codes.data());
            p.scales = address(side.data());
            p.out = address(out.data());
            p.m = m;
            p.n = s.n;
            p.k = s.k;
            p.group = s.group;
            p.flags = kGemmInt4 | kGemmPanels | (zp ? kGemmZeroPoints | kGemmFp16Scales : 0u);
            // Blocks as the module cuts them: 64 columns (tiled) or 256 (decode).
            const std::int64_t tile = tiled ? 64 : 256;
            for (std::int64_t n0 = 0; n0 < s.n; n0 += tile) {
              const std::int64_t n1 = std::min(s.n, n0 + tile);
              if (tiled) {
                gemm_tiled(p, n0, n1, 0, m, isa);
              } else {
                gemm_decode(p, n0, n1, isa);
              }
            }
            const toolkit::GemmTolerance tol =
                toolkit::gemm_tolerance(ops::GemmRoute::kTiled, WeightFormat::kInt4);
            const toolkit::Reference ref = toolkit::reference(a, m, w, {}, tol);
            testing::gemm::expect_close(
                toolkit::compare(std::span(out.data(), static_cast<std::size_t>(m * s.n)), ref),
                tol.normalized, "against the float64 reference");
            for (std::size_t i = 0; i < kTail; ++i) {
              ASSERT_EQ(out[static_cast<std::size_t>(m * s.n) + i], toolkit::kPoisonBf16)
                  << "element " << i << " past C was written";
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace metrale::cpu::w4a16
