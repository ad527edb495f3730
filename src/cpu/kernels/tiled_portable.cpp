// The tiled route without vector instructions the binary may not assume (tiled_panels.h has the
// block loop): the FP32 kernels' panels and register tiles in plain loops, which the compiler
// vectorizes for the baseline instruction set.
#include <vector>

#include "cpu/kernels/tiled_panels.h"
#include "cpu/kernels/w4a16_shared.h"

namespace metrale::cpu::w4a16::detail {
namespace {

struct PortableKernel {
  using Panel = float;
  using AElem = float;
  static constexpr int kRows = 4;
  static const AElem* stage(const GemmParams& p, std::int64_t k0, std::int64_t kc,
                            std::vector<AElem>& staged, std::int64_t& lda) {
    return staged_a_f32(p, k0, kc, staged, lda);
  }
  // k of column c at k * 32 + c, the block scale multiplied in; columns past nc are zero.
  static void pack(const Weights& w, std::int64_t n0, std::int64_t nc, std::int64_t k0,
                   std::int64_t kc, Panel* panel) {
    const float* e2m1 = tables().e2m1;
    for (std::int64_t c = 0; c < kPanelCols; ++c) {
      for (std::int64_t k = 0; k < kc; ++k) {
        panel[k * kPanelCols + c] =
            c < nc ? e2m1[w.code(n0 + c, k0 + k)] * w.scale(n0 + c, (k0 + k) / w.group) : 0.0f;
      }
    }
  }
  static void tile(int rows, const AElem* a, std::int64_t lda, const Panel* panel, std::int64_t kc,
                   float* acc, std::int64_t ldc) {
    for (std::int64_t k = 0; k < kc; ++k) {
      const float* w = panel + k * kPanelCols;
      for (int r = 0; r < rows; ++r) {
        const float x = a[r * lda + k];
        float* out = acc + r * ldc;
        for (int c = 0; c < kPanelCols; ++c) out[c] += x * w[c];
      }
    }
  }
};

}  // namespace

void tiled_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  tiled_block<PortableKernel>(p, n0, n1);
}

}  // namespace metrale::cpu::w4a16::detail
