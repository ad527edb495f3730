// The small-M kernels over the panel layout (panels_small.h). On AVX-512 BF16, two groups of 16
// columns and up to four rows at a time walk the whole K (panel_sums_avx512.h), and the sums of
// one block are scaled once by the block's FP32 scales, as the decode kernel does. So any E8M0
// scale is exact here, and each line is decoded once for all rows (see Note [CPU panel layout]
// in docs/NOTES.md).
#include <immintrin.h>

#include <algorithm>

#include "cpu/kernels/panel_sums_avx512.h"
#include "cpu/kernels/panels_small.h"
#include "cpu/kernels/scales_avx512.h"
#include "cpu/kernels/w4a16_shared.h"
#include "kernels/panel_layout.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {
namespace {

namespace pl = panel_layout;

// Rows [0, MR) of p (A and C start there) × columns 16g..16g+31, LPB lines per scale block.
template <int MR, int LPB>
[[METRALE_TARGET_AVX512BF16]] void two_groups(const GemmParams& p, const Weights& w, std::int64_t g,
                                              std::int64_t n1) {
  const __m512i lut = _mm512_load_si512(tables().e2m1_bf16);
  const auto* a = at<const std::uint16_t>(p.a);
  const std::int64_t blocks = w.k / w.group;
  const std::uint8_t* src[2] = {w.codes + pl::line_offset(w.k, g, 0),
                                w.codes + pl::line_offset(w.k, g + 1, 0)};
  const std::uint8_t* sc[2] = {
      w.scales + pl::scale_offset(w.k, static_cast<int>(w.group), g, 0),
      w.scales + pl::scale_offset(w.k, static_cast<int>(w.group), g + 1, 0)};
  __m512 acc[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (std::int64_t b = 0; b < blocks; ++b) {
    __m512 sum[MR][2];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
    add_block<MR, LPB, true>(a, p.k, src, b * LPB, lut, sum);
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const __m512 scale = scales16_at(sc[i] + b * pl::kGroupCols, w.mxfp4);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][i] = _mm512_fmadd_ps(sum[r][i], scale, acc[r][i]);
    }
  }
  const std::int64_t n0 = g * pl::kGroupCols;
  for (int r = 0; r < MR; ++r) {
    alignas(64) float out[2 * pl::kGroupCols];
    _mm512_store_ps(out, acc[r][0]);
    _mm512_store_ps(out + pl::kGroupCols, acc[r][1]);
    for (std::int64_t c = 0; c < std::min<std::int64_t>(2 * pl::kGroupCols, n1 - n0); ++c) {
      store(p, r, n0 + c, out[c]);
    }
  }
}

template <int LPB>
void rows_of(const GemmParams& p, const Weights& w, std::int64_t g, std::int64_t n1) {
  // Up to 4 rows at a time: more would spill the 2 × 2 accumulators a row takes.
  for (std::int64_t m0 = 0; m0 < p.m; m0 += 4) {
    GemmParams q = p;
    q.a += static_cast<std::uint64_t>(m0 * p.k * 2);
    q.out += static_cast<std::uint64_t>(m0 * p.n * ((p.flags & kGemmOutF32) ? 4 : 2));
    q.m = std::min<std::int64_t>(4, p.m - m0);
    switch (q.m) {
      case 1:
        two_groups<1, LPB>(q, w, g, n1);
        break;
      case 2:
        two_groups<2, LPB>(q, w, g, n1);
        break;
      case 3:
        two_groups<3, LPB>(q, w, g, n1);
        break;
      default:
        two_groups<4, LPB>(q, w, g, n1);
        break;
    }
  }
}

}  // namespace

void panels_small_avx512bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Weights w(p);
  for (std::int64_t g = n0 / pl::kGroupCols; g * pl::kGroupCols < n1; g += 2) {
    if (w.mxfp4) {
      rows_of<4>(p, w, g, n1);  // 32 K per scale: 4 lines
    } else {
      rows_of<2>(p, w, g, n1);
    }
  }
}

void panels_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Weights w(p);
  const Tables& t = tables();
  const std::int64_t blocks = w.k / w.group;
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t n = n0; n < n1; ++n) {
      float sum = 0.0f;
      for (std::int64_t b = 0; b < blocks; ++b) {
        float part = 0.0f;
        for (std::int64_t k = b * w.group; k < (b + 1) * w.group; ++k) {
          part += t.e2m1[pl::code_at(w.codes, w.k, n, k)] * a_at(p, m, k);
        }
        const std::uint8_t s = pl::scale_at(w.scales, w.k, static_cast<int>(w.group), n, b);
        sum += part * (w.mxfp4 ? t.e8m0[s] : t.e4m3[s]);
      }
      store(p, m, n, sum);
    }
  }
}

}  // namespace metrale::cpu::w4a16::detail
