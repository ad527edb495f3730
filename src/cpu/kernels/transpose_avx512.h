// A 16 × 16 transpose of dwords in AVX-512 registers, for the kernels that turn 16 columns' rows
// of codes into vectors of one K each (tiled_avx512.cpp, int4_tiled.cpp). Internal to
// src/cpu/kernels.
#pragma once

#include <immintrin.h>

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace metrale::cpu::w4a16::detail {

// rows[i] dword j -> rows[j] dword i: 16 × 16 dwords in four rounds of 16 shuffles.
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma"), gnu::always_inline]] inline void
transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // b[4g + c], 128-bit lane l: column 4l + c of rows 4g..4g+3.
  for (int g = 0; g < 16; g += 4) {
    b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
    b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
    b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
    b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88);
    const __m512i e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i f0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i f1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(e0, f0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(e0, f0, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(e1, f1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(e1, f1, 0xDD);
  }
}

}  // namespace metrale::cpu::w4a16::detail
