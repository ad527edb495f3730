// One 128-weight step of the decode kernels with AVX-512 BF16 (decode_bf16.cpp for E2M1,
// int4_bf16.cpp for INT4), shared: A staged to match the step's order, the 64 code bytes looked up
// in a 32-entry BF16 table, and the four vdpbf16ps of one row. Layout (decode_bf16.cpp's header):
// word i of the 64 bytes holds k = 4i..4i+3; lookup r holds weight 4i + r in element i; lane j of
// the dot sums k = 8j..8j+7. Internal to src/cpu/kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu/kernels/w4a16_shared.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace metrale::cpu::w4a16::detail {

// The four index vectors of stage_step: element i of vector r is index 4i + r of two
// concatenated vectors (i < 16).
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline void every4th_indices(__m512i* every4th) {
  for (int r = 0; r < 4; ++r) {
    alignas(64) std::uint16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = static_cast<std::uint16_t>((4 * i + r) & 63);
    every4th[r] = _mm512_load_si512(idx);
  }
}

// A's 128 BF16 values at src into dst as four vectors of 32, vector r holding A[4i + r]: two
// permutes and an insert per vector.
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline void stage_step(const std::uint16_t* src,
                                                                         std::uint16_t* dst,
                                                                         const __m512i* every4th) {
  const __m512i v0 = _mm512_loadu_si512(src), v1 = _mm512_loadu_si512(src + 32);
  const __m512i v2 = _mm512_loadu_si512(src + 64), v3 = _mm512_loadu_si512(src + 96);
  for (int r = 0; r < 4; ++r) {
    const __m512i lo = _mm512_permutex2var_epi16(v0, every4th[r], v1);
    const __m512i hi = _mm512_permutex2var_epi16(v2, every4th[r], v3);
    _mm512_storeu_si512(dst + 32 * r, _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1));
  }
}

// The step's 64 code bytes looked up: vpermw reads 5 index bits, so the word itself and the word
// shifted right by 4, 8 and 12 look up nibble r of every word in `lut` (each value twice).
struct StepWeights {
  __m512bh w[4];
};
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline StepWeights lookup_step(
    const std::uint8_t* codes, __m512i lut) {
  const __m512i v = _mm512_loadu_si512(codes);
  StepWeights s;
  s.w[0] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(v, lut));
  s.w[1] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut));
  s.w[2] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), lut));
  s.w[3] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), lut));
  return s;
}

// One row's dot products of the step: lane j sums the step's k = 8j..8j+7 (am: the row's staged
// step).
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline __m512 dot_step(const StepWeights& s,
                                                                         const std::uint16_t* am) {
  __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), s.w[0],
                                reinterpret_cast<__m512bh>(_mm512_loadu_si512(am)));
  dot = _mm512_dpbf16_ps(dot, s.w[1], reinterpret_cast<__m512bh>(_mm512_loadu_si512(am + 32)));
  dot = _mm512_dpbf16_ps(dot, s.w[2], reinterpret_cast<__m512bh>(_mm512_loadu_si512(am + 64)));
  return _mm512_dpbf16_ps(dot, s.w[3], reinterpret_cast<__m512bh>(_mm512_loadu_si512(am + 96)));
}

}  // namespace metrale::cpu::w4a16::detail
