// The tiled route without vector instructions the binary may not assume (tiled_panels.h has the
// block loop): the FP32 kernels' panels and register tiles in plain loops, which the compiler
// vectorizes for the baseline instruction set.
#include <vector>

#include "cpu/kernels/tiled_panels.h"
#include "cpu/kernels/w4a16_shared.h"

namespace metrale::cpu::w4a16::detail {
namespace {

// k of column c at k * 32 + c, the block scale multiplied in; columns past nc are zero.
void pack(const Weights& w, std::int64_t n0, std::int64_t nc, std::int64_t k0, std::int64_t kc,
          float* panel) {
  // The scales looked up once per block (Weights::scale divides per call), a weight's block
  // found by shift.
  alignas(64) float scales[kPanelK / 16 * kPanelCols];
  panel_scales(w, n0, nc, k0, kc, scales);
  const int group_shift = pair_group_shift(w) + 1;
  const float* e2m1 = tables().e2m1;
  for (std::int64_t c = 0; c < kPanelCols; ++c) {
    for (std::int64_t k = 0; k < kc; ++k) {
      panel[k * kPanelCols + c] =
          c < nc ? e2m1[w.code(n0 + c, k0 + k)] * scales[(k >> group_shift) * kPanelCols + c]
                 : 0.0f;
    }
  }
}

template <int MR>
void tile(const float* a, std::int64_t lda, const float* panel, std::int64_t kc, float* acc,
          std::int64_t ldc) {
  for (std::int64_t k = 0; k < kc; ++k) {
    const float* w = panel + k * kPanelCols;
    for (int r = 0; r < MR; ++r) {
      const float x = a[r * lda + k];
      float* out = acc + r * ldc;
      for (int c = 0; c < kPanelCols; ++c) out[c] += x * w[c];
    }
  }
}

constexpr void (*kTiles[])(const float*, std::int64_t, const float*, std::int64_t, float*,
                           std::int64_t) = {tile<1>, tile<2>, tile<3>, tile<4>};

}  // namespace

void tiled_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  tiled_block(p, n0, n1, TiledKernel<float, float>{4, kPanelK, staged_a_f32, pack, kTiles});
}

}  // namespace metrale::cpu::w4a16::detail
