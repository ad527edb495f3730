// The tiled route for INT4 weights on processors with AVX-512 BF16 (Note [INT4 weights]): per 32
// output columns, K in panels that lie inside one group, each panel's codes decoded once per
// block into BF16 pairs of code − 8 (exact) in tiled_avx512.cpp's panel layout (pair p of column c
// as one dword at p * 32 + c), then register tiles of 8 rows × 32 columns over every row of the
// block. A tile's panel sums are FP32 and untouched by the scale; at the panel's end they are
// multiplied by the 32 columns' group scales and added to C's FP32 sums, with the zero points'
// term (8 − zero)·s·Σa of each row (Σa over the panel's K, staged with A). Weights in the panel
// layout (kernels/panel_layout.h) fill the same panels from their lines, with no transpose.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu/kernels/int4_cpu.h"
#include "cpu/kernels/int4_scales_avx512.h"
#include "cpu/kernels/int4_shared.h"
#include "cpu/kernels/pairs_bf16.h"
#include "cpu/kernels/tiled_panels.h"
#include "cpu/kernels/transpose_avx512.h"
#include "cpu/kernels/w4a16_shared.h"
#include "kernels/panel_layout.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {
namespace {

constexpr int kRows = 8;  // a tile's rows: 16 sums and two panel vectors leave room to broadcast

// K per panel: the group where it is at most 256; else 256 or 128, whichever divides it (one
// scale per row: 256, the last panel shorter). A panel never spans two groups.
std::int64_t panel_k_of(const Int4Weights& w) {
  if (w.group == w.k) return kPanelK;
  if (w.group <= kPanelK) return w.group;
  return w.group % kPanelK == 0 ? kPanelK : 128;
}

// Pair p of 16 columns (their codes' low byte: two nibbles) written as BF16 (code − 8) pairs: the
// dword's low word indexes the table with the low nibble, its high word (the dword shifted left by
// 12) with the high one, so one vpermw gives the pair as vdpbf16ps takes it.
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline void put_codes(std::uint32_t* panel,
                                                                        std::int64_t p, int c0,
                                                                        __m512i bytes,
                                                                        __m512i lut) {
  const __m512i index = _mm512_mask_mov_epi16(bytes, 0xAAAAAAAA, _mm512_slli_epi32(bytes, 12));
  _mm512_storeu_si512(panel + p * kPanelCols + c0, _mm512_permutexvar_epi16(index, lut));
}

// Columns [n0, n0 + nc) × stored K [k0, k0 + kc) as BF16 pairs of code − 8; columns past nc 0.
[[METRALE_TARGET_AVX512BF16]] void pack_codes(const Int4Weights& w, std::int64_t n0,
                                              std::int64_t nc, std::int64_t k0, std::int64_t kc,
                                              std::uint32_t* panel) {
  const __m512i lut = _mm512_load_si512(int4_bf16_lut().words);
  const std::int64_t pairs = kc / 2, row_bytes = w.k / 2;
  for (int c0 = 0; c0 < kPanelCols; c0 += 16) {
    const int live = static_cast<int>(std::clamp<std::int64_t>(nc - c0, 0, 16));
    // 64 code bytes (64 pairs) of 16 columns at a time, transposed so that vector d holds pairs
    // 4d..4d+3 of every column, one byte each; a last part of fewer whole dwords, masked.
    for (std::int64_t p0 = 0; p0 < pairs; p0 += 64) {
      const std::int64_t left = std::min<std::int64_t>(64, pairs - p0);
      const int words = static_cast<int>((left + 3) / 4);
      const auto mask = static_cast<__mmask64>(left >= 64 ? ~0ull : (1ull << left) - 1);
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        if (j >= live) {
          r[j] = _mm512_set1_epi8(static_cast<char>(0x88));  // code 8: weight 0
          continue;
        }
        const std::uint8_t* src = w.codes + (n0 + c0 + j) * row_bytes + k0 / 2 + p0;
        r[j] = _mm512_mask_loadu_epi8(_mm512_set1_epi8(static_cast<char>(0x88)), mask, src);
        _mm_prefetch(reinterpret_cast<const char*>(src + kc / 2), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(src + 2 * kc), _MM_HINT_T1);
      }
      transpose16(r);
      for (int d = 0; d < words; ++d) {
        const std::int64_t p = p0 + 4 * d;
        for (int s = 0; s < 4 && p + s < pairs; ++s) {
          put_codes(panel, p + s, c0, s == 0 ? r[d] : _mm512_srli_epi32(r[d], 8 * s), lut);
        }
      }
    }
  }
}

// The same panel from weights in the panel layout (kernels/panel_layout.h; n0 a multiple of 32):
// each line's words shifted by 0, 4, 8 and 12 look up four of the panel's pair vectors, with no
// transpose (Note [CPU panel layout]).
[[METRALE_TARGET_AVX512BF16]] void pack_lines(const Int4Weights& w, std::int64_t n0, std::int64_t,
                                              std::int64_t k0, std::int64_t kc,
                                              std::uint32_t* panel) {
  namespace pl = panel_layout;
  const __m512i lut = _mm512_load_si512(int4_bf16_lut().words);
  for (int i = 0; i < 2; ++i) {
    const std::uint8_t* line =
        w.codes + pl::line_offset(w.k, n0 / pl::kGroupCols + i, k0 / pl::kLineK);
    for (std::int64_t t = 0; t < kc / pl::kLineK; ++t) {
      const __m512i v = _mm512_loadu_si512(line + t * pl::kLineBytes);
      // The next panel's line, as an integer: past the last panel it lies past the buffer.
      const auto ahead = reinterpret_cast<std::uintptr_t>(line + t * pl::kLineBytes);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + kc / pl::kLineK * pl::kLineBytes),
                   _MM_HINT_T0);
      for (int s = 0; s < 4; ++s) {
        const __m512i index = s == 0 ? v : _mm512_srli_epi16(v, pl::nibble_shift(s));
        _mm512_storeu_si512(panel + (4 * t + s) * kPanelCols + i * pl::kGroupCols,
                            _mm512_permutexvar_epi16(index, lut));
      }
    }
  }
}

// acc[MR rows, 32] += scale · (A[MR rows, kc] · panel) + Σa[row] · offset, per column.
template <int MR>
[[METRALE_TARGET_AVX512BF16]] void tile(const std::uint16_t* a, std::int64_t lda,
                                        const std::uint32_t* panel, std::int64_t kc, float* acc,
                                        std::int64_t ldc, const float* scale, const float* offset,
                                        const float* sums) {
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  add_panel_products<MR>(a, lda, panel, kc, c);
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  for (int r = 0; r < MR; ++r) {
    __m512 t0 = _mm512_fmadd_ps(c[r][0], s0, _mm512_loadu_ps(acc + r * ldc));
    __m512 t1 = _mm512_fmadd_ps(c[r][1], s1, _mm512_loadu_ps(acc + r * ldc + 16));
    if (offset != nullptr) {
      const __m512 sum = _mm512_set1_ps(sums[r]);
      t0 = _mm512_fmadd_ps(sum, _mm512_loadu_ps(offset), t0);
      t1 = _mm512_fmadd_ps(sum, _mm512_loadu_ps(offset + 16), t1);
    }
    _mm512_storeu_ps(acc + r * ldc, t0);
    _mm512_storeu_ps(acc + r * ldc + 16, t1);
  }
}

constexpr void (*kTiles[])(const std::uint16_t*, std::int64_t, const std::uint32_t*, std::int64_t,
                           float*, std::int64_t, const float*, const float*, const float*) = {
    tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

// A's rows over stored K [k0, k0 + kc), read where they are (in the stored order already under act
// order: permute_a_int4), and with `sums` each row's Σa over them (for the zero points' term).
[[METRALE_TARGET_AVX512BF16]] const std::uint16_t* stage(const GemmParams& p, std::int64_t k0,
                                                         std::int64_t kc, bool sums,
                                                         std::int64_t& lda,
                                                         std::vector<float>& row_sums) {
  const auto* a = at<const std::uint16_t>(p.a);
  const std::uint16_t* out = a + k0;
  lda = p.k;
  if (sums) {
    row_sums.resize(static_cast<std::size_t>(p.m + kRows));
    for (std::int64_t m = 0; m < p.m; ++m) {
      const std::uint16_t* src = out + m * lda;
      __m512 t = _mm512_setzero_ps();
      std::int64_t j = 0;
      for (; j + 16 <= kc; j += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
        t = _mm512_add_ps(t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
      float sum = _mm512_reduce_add_ps(t);
      for (; j < kc; ++j) sum += num::bf16_to_f32(src[j]);
      row_sums[static_cast<std::size_t>(m)] = sum;
    }
  }
  return out;
}

}  // namespace

void int4_tiled_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Int4Weights w(p);
  const bool zp = w.zeros != nullptr, lines = (p.flags & kGemmPanels) != 0;
  const std::int64_t panel_k = panel_k_of(w);
  const std::int64_t ldc = (n1 - n0 + kPanelCols - 1) / kPanelCols * kPanelCols;
  thread_local std::vector<float> acc, row_sums, scales, offsets;
  thread_local std::vector<std::uint32_t> panel;
  acc.assign(static_cast<std::size_t>(p.m * ldc), 0.0f);
  panel.resize(static_cast<std::size_t>(kPanelK / 2 * kPanelCols));
  scales.resize(static_cast<std::size_t>(w.groups * ldc));
  offsets.resize(scales.size());
  block_scales(w, n0, n1 - n0, ldc, scales.data(), offsets.data());
  for (std::int64_t k0 = 0; k0 < p.k; k0 += panel_k) {
    const std::int64_t kc = std::min(panel_k, p.k - k0), g = k0 / w.group;
    std::int64_t lda = 0;
    const std::uint16_t* a = stage(p, k0, kc, zp, lda, row_sums);
    for (std::int64_t n = n0; n < n1; n += kPanelCols) {
      const std::int64_t nc = std::min<std::int64_t>(kPanelCols, n1 - n);
      if (lines) {
        pack_lines(w, n, nc, k0, kc, panel.data());
      } else {
        pack_codes(w, n, nc, k0, kc, panel.data());
      }
      const float* scale = scales.data() + g * ldc + (n - n0);
      const float* offset = zp ? offsets.data() + g * ldc + (n - n0) : nullptr;
      for (std::int64_t m = 0; m < p.m; m += kRows) {
        const auto rows = static_cast<int>(std::min<std::int64_t>(kRows, p.m - m));
        kTiles[rows - 1](a + m * lda, lda, panel.data(), kc, acc.data() + m * ldc + (n - n0), ldc,
                         scale, offset, zp ? row_sums.data() + m : nullptr);
      }
    }
  }
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t c = 0; c < n1 - n0; ++c) store(p, m, n0 + c, acc[m * ldc + c]);
  }
}

}  // namespace metrale::cpu::w4a16::detail
