// What the tiled route's CPU kernels share (tiled_avx512.cpp, tiled_avx2.cpp, tiled_portable.cpp):
// the block structure, the panel sizes and the rule for scales that panels cannot carry. Internal
// to src/cpu/kernels. See Note [CPU tiled panels] in docs/NOTES.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/kernels/w4a16_shared.h"
#include "kernels/gemm_params.h"
#include "kernels/panel_layout.h"

namespace metrale::cpu::w4a16::detail {

// Columns of one register tile and of one dequantized panel: two 16-lane vectors.
inline constexpr int kPanelCols = 32;
// The largest K per panel, a multiple of both group sizes: 256 × 32 weights are 16 KiB as BF16
// pairs (32 KiB as FP32), so the panel stays in L1 while every row tile of the M block reads it.
// A kernel may take less (TiledKernel::panel_k).
inline constexpr std::int64_t kPanelK = 256;

// Whether a panel may hold columns [n0, n0 + nc) with their block scales multiplied in. An E2M1
// value times an E4M3 scale is exact in BF16 and FP32, but an E8M0 scale of 2^-127 or 2^-126
// makes some products subnormal (flushed by vdpbf16ps) and one of 2^126 or 2^127 makes some
// overflow, where scaling each block's FP32 sum does not; such columns take the decode kernels.
inline bool scales_fit_panels(const Weights& w, std::int64_t n0, std::int64_t nc) {
  if (!w.mxfp4) return true;
  const std::int64_t groups = w.k / w.group;
  for (std::int64_t c = n0; c < n0 + nc; ++c) {
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::uint8_t s = w.transposed ? w.scales[g * w.n + c] : w.scales[c * groups + g];
      if (s <= 1 || s == 253 || s == 254) return false;
    }
  }
  return true;
}

// scales_fit_panels for weights in the panel layout (kernels/panel_layout.h).
inline bool panel_scales_fit(const Weights& w, std::int64_t n0, std::int64_t nc) {
  if (!w.mxfp4) return true;
  const std::int64_t blocks = w.k / w.group;
  for (std::int64_t c = n0; c < n0 + nc; ++c) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::uint8_t s = panel_layout::scale_at(w.scales, w.k, static_cast<int>(w.group), c, b);
      if (s <= 1 || s == 253 || s == 254) return false;
    }
  }
  return true;
}

// The block scale of each panel column for each group of [k0, k0 + kc): out[g * kPanelCols + c],
// zero for the columns past nc (their codes are zero too). Weights::scale divides per call, and
// this runs for every 8 K of a panel's column.
inline void panel_scales(const Weights& w, std::int64_t n0, std::int64_t nc, std::int64_t k0,
                         std::int64_t kc, float* out) {
  const float* table = w.mxfp4 ? tables().e8m0 : tables().e4m3;
  const std::int64_t groups = w.k / w.group, g0 = k0 / w.group, count = kc / w.group;
  for (std::int64_t c = 0; c < kPanelCols; ++c) {
    if (c >= nc) {
      for (std::int64_t g = 0; g < count; ++g) out[g * kPanelCols + c] = 0.0f;
      continue;
    }
    if (w.transposed) {
      for (std::int64_t g = 0; g < count; ++g) {
        out[g * kPanelCols + c] = table[w.scales[(g0 + g) * w.n + n0 + c]];
      }
    } else {
      const std::uint8_t* s = w.scales + (n0 + c) * groups + g0;
      for (std::int64_t g = 0; g < count; ++g) out[g * kPanelCols + c] = table[s[g]];
      __builtin_prefetch(s + count);  // the next panel's, as the codes (tiled_avx512.cpp)
    }
  }
}

// log2 of the pairs per group (8 for NVFP4, 16 for MXFP4): a pair's group by shift.
inline int pair_group_shift(const Weights& w) {
  return w.mxfp4 ? 4 : 3;
}

// One instruction set's tiled kernel: how A is read, how a panel is packed, and its register
// tiles by row count (tiles[r - 1] runs r rows, r <= rows).
template <class Panel, class AElem>
struct TiledKernel {
  int rows;
  std::int64_t panel_k;  // K per panel: a multiple of 32 up to kPanelK
  // A's rows [0, M) × [k0, k0 + kc) as the tiles read them; sets lda.
  const AElem* (*stage)(const GemmParams&, std::int64_t k0, std::int64_t kc, std::vector<AElem>&,
                        std::int64_t& lda);
  // Columns [n0, n0 + nc) × [k0, k0 + kc) dequantized into a panel; columns past nc zero.
  void (*pack)(const Weights&, std::int64_t n0, std::int64_t nc, std::int64_t k0, std::int64_t kc,
               Panel*);
  // acc[r rows, 32] (FP32, row stride ldc) += A[r rows, kc] · panel.
  void (*const* tiles)(const AElem* a, std::int64_t lda, const Panel*, std::int64_t kc, float* acc,
                       std::int64_t ldc);
};

// The block loop of every tiled kernel. Per K panel: A's rows staged once, then per 32 columns
// their weights dequantized once and every row tile of the block run over that panel, FP32 sums
// kept per output across panels.
template <class Panel, class AElem>
void tiled_block(const GemmParams& p, std::int64_t n0, std::int64_t n1,
                 const TiledKernel<Panel, AElem>& kernel) {
  const Weights w(p);
  const std::int64_t ldc = (n1 - n0 + kPanelCols - 1) / kPanelCols * kPanelCols;
  thread_local std::vector<float> acc;
  thread_local std::vector<Panel> panel;
  thread_local std::vector<AElem> staged;
  acc.assign(static_cast<std::size_t>(p.m * ldc), 0.0f);
  panel.resize(static_cast<std::size_t>(kernel.panel_k * kPanelCols));
  for (std::int64_t k0 = 0; k0 < p.k; k0 += kernel.panel_k) {
    const std::int64_t kc = std::min(kernel.panel_k, p.k - k0);
    std::int64_t lda = 0;
    const AElem* a = kernel.stage(p, k0, kc, staged, lda);
    for (std::int64_t n = n0; n < n1; n += kPanelCols) {
      kernel.pack(w, n, std::min<std::int64_t>(kPanelCols, n1 - n), k0, kc, panel.data());
      for (std::int64_t m = 0; m < p.m; m += kernel.rows) {
        const auto rows = static_cast<int>(std::min<std::int64_t>(kernel.rows, p.m - m));
        kernel.tiles[rows - 1](a + m * lda, lda, panel.data(), kc, acc.data() + m * ldc + (n - n0),
                               ldc);
      }
    }
  }
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t c = 0; c < n1 - n0; ++c) store(p, m, n0 + c, acc[m * ldc + c]);
  }
}

// A's rows as they lie, for kernels that broadcast BF16 pairs from A itself. (A copy with rows
// kc × 2 bytes apart, against K × 2 that puts a row tile's rows in one L1 set, measured no
// faster at M = 64 and 256.)
inline const std::uint16_t* unstaged_a(const GemmParams& p, std::int64_t k0, std::int64_t,
                                       std::vector<std::uint16_t>&, std::int64_t& lda) {
  lda = p.k;
  return at<const std::uint16_t>(p.a) + k0;
}

// BF16 to FP32 one at a time: the portable kernels' widening and every kernel's last K % W.
inline void widen_scalar(const std::uint16_t* src, float* dst, std::int64_t count) {
  for (std::int64_t k = 0; k < count; ++k) dst[k] = num::bf16_to_f32(src[k]);
}

// A's rows [0, M) × [k0, k0 + kc) in FP32, row stride kc: the first K rounded down to W of each
// row by widen(src, dst, count) (a vector conversion of the calling kernel's instruction set,
// count a multiple of W), the rest one at a time. Every block stages its rows again for each K
// panel, which in scalar code cost a third as many instructions as the block's multiply-adds at
// M = 256 on AVX2 and 14% of the AVX-512F route at M = 16.
template <int W>
inline const float* staged_a_f32_by(const GemmParams& p, std::int64_t k0, std::int64_t kc,
                                    std::vector<float>& staged, std::int64_t& lda,
                                    void (*widen)(const std::uint16_t*, float*, std::int64_t)) {
  staged.resize(static_cast<std::size_t>(p.m * kc));
  const auto* a = at<const std::uint16_t>(p.a);
  const std::int64_t kw = kc / W * W;
  for (std::int64_t m = 0; m < p.m; ++m) {
    const std::uint16_t* src = a + m * p.k + k0;
    float* dst = staged.data() + m * kc;
    widen(src, dst, kw);
    widen_scalar(src + kw, dst + kw, kc - kw);
  }
  lda = kc;
  return staged.data();
}

// A staged one element at a time, for the portable kernels.
inline const float* staged_a_f32(const GemmParams& p, std::int64_t k0, std::int64_t kc,
                                 std::vector<float>& staged, std::int64_t& lda) {
  return staged_a_f32_by<1>(p, k0, kc, staged, lda, widen_scalar);
}

// The tiled kernels per instruction set (tiled_avx512.cpp, tiled_avx2.cpp, tiled_portable.cpp):
// C[:, n0:n1] for weights whose scales fit panels; the caller has checked the processor.
void tiled_avx512bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1);
// The same over weights in the panel layout (kGemmPanels), n0 a multiple of 32.
void tiled_avx512bf16_panels(const GemmParams& p, std::int64_t n0, std::int64_t n1);
void tiled_avx512(const GemmParams& p, std::int64_t n0, std::int64_t n1);
void tiled_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1);
void tiled_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::w4a16::detail
