// Group scales and zero-point offsets of INT4 weights decoded for 16 columns at a time, for the
// AVX-512 BF16 kernels that scale a block's sum per column (int4_tiled.cpp, int4_panels.cpp).
// Internal to src/cpu/kernels; include only from files whose functions are compiled for AVX-512
// BF16 (see Note [INT4 weights] in docs/NOTES.md).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/kernels/int4_shared.h"
#include "cpu/kernels/transpose_avx512.h"
#include "cpu/kernels/w4a16_shared.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target
// (and GCC 12 reads the transposes' masked loads as uninitialized).
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {

// block_scales for weights in the panel layout, whose entries are in panel order
// (int4_layout::panel_entry): one group's 16 columns are one load. n0 is a multiple of 16, as
// everywhere the panel kernels run (their lines hold 16 columns: panel_layout::line_offset).
[[METRALE_TARGET_AVX512BF16]] inline void panel_block_scales(const Int4Weights& w, std::int64_t n0,
                                                             std::int64_t nc, std::int64_t ld,
                                                             float* scales, float* offsets) {
  for (std::int64_t c0 = 0; c0 < ld; c0 += 16) {
    const std::int64_t live = std::clamp<std::int64_t>(nc - c0, 0, 16);
    const auto lanes = static_cast<__mmask16>(live >= 16 ? 0xFFFF : (1u << live) - 1);
    for (std::int64_t g = 0; g < w.groups; ++g) {
      // Lanes past nc load 0: a scale of 0 and an offset of 0.
      const auto at = static_cast<std::int64_t>(
          live == 0 ? 0 : int4_layout::panel_entry(w.n, w.groups, n0 + c0, g));
      const __m256i raw = _mm256_maskz_loadu_epi16(lanes, w.scales + 2 * at);
      const __m512 v = w.fp16
                           ? _mm512_cvtph_ps(raw)
                           : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      _mm512_storeu_ps(scales + g * ld + c0, v);
      if (w.zeros == nullptr) continue;
      const __m512i z = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, w.zeros + at));
      _mm512_storeu_ps(
          offsets + g * ld + c0,
          _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(8.0f), _mm512_cvtepi32_ps(z)), v));
    }
  }
}

// Every group's scale and zero-point offset (8 − zero)·s of columns [n0, n0 + nc), decoded once per
// block: scales[g * ld + c] and offsets alike. Row-major entries: 16 columns' 16 groups at a time
// transposed so that a vector holds one group of 16 columns (decoding 32 columns one by one per
// panel cost as much as the tiles' products at M = 16); in panel order (the panel layout),
// panel_block_scales. Columns past nc are 0. Symmetric weights write no offsets.
[[METRALE_TARGET_AVX512BF16]] inline void block_scales(const Int4Weights& w, std::int64_t n0,
                                                       std::int64_t nc, std::int64_t ld,
                                                       float* scales, float* offsets) {
  if (w.panels) return panel_block_scales(w, n0, nc, ld, scales, offsets);
  for (std::int64_t c0 = 0; c0 < ld; c0 += 16) {
    const std::int64_t live = std::clamp<std::int64_t>(nc - c0, 0, 16);
    for (std::int64_t g0 = 0; g0 < w.groups; g0 += 16) {
      const std::int64_t count = std::min<std::int64_t>(16, w.groups - g0);
      const auto groups = static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
      __m512i s[16], o[16];
      for (int j = 0; j < 16; ++j) {
        if (j >= live) {
          s[j] = o[j] = _mm512_setzero_si512();
          continue;
        }
        const std::int64_t row = (n0 + c0 + j) * w.groups + g0;
        const __m256i raw = _mm256_maskz_loadu_epi16(groups, w.scales + 2 * row);
        const __m512 v =
            w.fp16 ? _mm512_cvtph_ps(raw)
                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        s[j] = _mm512_castps_si512(v);
        __m512 off = _mm512_setzero_ps();
        if (w.zeros != nullptr) {
          const __m512i z = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(groups, w.zeros + row));
          off = _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(8.0f), _mm512_cvtepi32_ps(z)), v);
        }
        o[j] = _mm512_castps_si512(off);
      }
      transpose16(s);
      for (std::int64_t g = 0; g < count; ++g) {
        _mm512_storeu_ps(scales + (g0 + g) * ld + c0, _mm512_castsi512_ps(s[g]));
      }
      if (w.zeros == nullptr) continue;
      transpose16(o);
      for (std::int64_t g = 0; g < count; ++g) {
        _mm512_storeu_ps(offsets + (g0 + g) * ld + c0, _mm512_castsi512_ps(o[g]));
      }
    }
  }
}

}  // namespace metrale::cpu::w4a16::detail
