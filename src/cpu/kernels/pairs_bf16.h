// The register tile's product loop of the tiled kernels with AVX-512 BF16 (tiled_avx512.cpp's
// FP4 tiles, int4_tiled.cpp's INT4 ones): MR rows of A against a BF16 panel (pair p of column c
// as one dword at p * 32 + c), 32 columns in two vectors. Internal to src/cpu/kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels/tiled_panels.h"
#include "cpu/kernels/w4a16_shared.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace metrale::cpu::w4a16::detail {

// c[r] += A[r, 0:kc] · panel, for r < MR (lda: A's row stride, kc even).
template <int MR>
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline void add_panel_products(
    const std::uint16_t* a, std::int64_t lda, const std::uint32_t* panel, std::int64_t kc,
    __m512 (&c)[MR][2]) {
  for (std::int64_t p = 0; p < kc / 2; ++p) {
    const auto w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * kPanelCols));
    const auto w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * kPanelCols + 16));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      // A's pair as one broadcast load. (A memcpy into a scalar and _mm512_set1_epi32 said the
      // same, but crashed clang 16 at -O2, which builds the fuzz targets.)
      const auto x =
          reinterpret_cast<__m512bh>(_mm512_broadcastd_epi32(_mm_loadu_si32(a + r * lda + 2 * p)));
      c[r][0] = _mm512_dpbf16_ps(c[r][0], w0, x);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], w1, x);
    }
  }
}

}  // namespace metrale::cpu::w4a16::detail
