// One scale block of the panel layout's kernels (panels_small.cpp, panels_tiled.cpp): two groups
// of 16 columns, up to six rows, each 64-byte line looked up into four vectors of BF16 pairs
// (its words shifted by 0, 4, 8, 12 index the E2M1 table) and each pair vector multiplied by
// every row's broadcast A pair. Internal to src/cpu/kernels; include only from files whose
// functions are compiled for AVX-512 BF16 (the helper is always inlined into them). See Note [CPU
// panel layout] in docs/NOTES.md.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels/w4a16_shared.h"
#include "kernels/panel_layout.h"

namespace metrale::cpu::w4a16::detail {

// Prefetch distances in bytes of a group's code run: a line into L1 a little ahead and one into
// L2 far ahead, as in the decode kernel (Note [L2 read-ahead distance]).
inline constexpr std::int64_t kPanelPrefetchL1 = 2048, kPanelPrefetchL2 = 16384;

// sum[r][i] += A[r, 8t .. 8t + 8 LPB) · column pairs of group i's lines t .. t + LPB - 1, where
// a points at A's row 0 at the k of line 0 (rows lda apart) and line[i] at group i's line 0.
// The caller zeroes sum per block and scales it once: the FP32 block sum of exact BF16 products.
template <int MR, int LPB, bool kPrefetch>
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline void add_block(
    const std::uint16_t* a, std::int64_t lda, const std::uint8_t* const line[2], std::int64_t t,
    __m512i lut, __m512 (&sum)[MR][2]) {
  namespace pl = panel_layout;
#pragma GCC unroll 4
  for (int h = 0; h < LPB; ++h, ++t) {
    __m512i codes[2];
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const std::uint8_t* at_line = line[i] + t * pl::kLineBytes;
      codes[i] = _mm512_loadu_si512(at_line);
      if constexpr (kPrefetch) {
        // Addresses as integers: near the end of the codes they lie past the buffer, where a
        // prefetch is harmless but pointer arithmetic is not defined.
        const auto ahead = reinterpret_cast<std::uintptr_t>(at_line);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + kPanelPrefetchL1), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + kPanelPrefetchL2), _MM_HINT_T1);
      }
    }
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m512bh pairs[2];
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        pairs[i] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(
            s == 0 ? codes[i] : _mm512_srli_epi16(codes[i], pl::nibble_shift(s)), lut));
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const auto x = reinterpret_cast<__m512bh>(
            _mm512_broadcastd_epi32(_mm_loadu_si32(a + r * lda + t * pl::kLineK + 2 * s)));
        sum[r][0] = _mm512_dpbf16_ps(sum[r][0], pairs[0], x);
        sum[r][1] = _mm512_dpbf16_ps(sum[r][1], pairs[1], x);
      }
    }
  }
}

}  // namespace metrale::cpu::w4a16::detail
