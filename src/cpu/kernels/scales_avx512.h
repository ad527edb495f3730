// Block scale codes decoded to FP32 in a vector, for the AVX-512 kernels (tiled_avx512.cpp,
// panels_small.cpp, panels_tiled.cpp). Internal to src/cpu/kernels; include only from files whose
// functions are compiled for AVX-512 (the helper is always inlined into them).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace metrale::cpu::w4a16::detail {

// 16 scale codes (one per lane, zero-extended) as FP32, as num::e4m3_to_f32 / e8m0_to_f32 give
// them. E4M3: the 7 magnitude bits placed under FP32's exponent field read as 2^-120 times the
// value (subnormals included, FP32 keeps them), so one exact multiply by 2^120 and the sign
// finish it. E8M0: the code is the exponent; 0 is 2^-127 (an FP32 subnormal). A gather from the
// tables cost 61% of the scales' time on Zen 4.
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma"), gnu::always_inline]] inline __m512
scales16(__m512i code, bool mxfp4) {
  if (mxfp4) {
    __m512i bits = _mm512_slli_epi32(code, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(code, _mm512_setzero_si512()),
                                 _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(255)),
                                 _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(bits);
  }
  const __m512i mag = _mm512_and_si512(code, _mm512_set1_epi32(0x7F));
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)),
                                     _mm512_castsi512_ps(_mm512_set1_epi32(0x7B800000)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(code, _mm512_set1_epi32(0x80)), 24);
  const __m512 signed_value =
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
  return _mm512_mask_mov_ps(signed_value, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                            _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

// The 16 scale codes at `codes` (one per column of a group) as scales16 gives them.
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma"), gnu::always_inline]] inline __m512
scales16_at(const std::uint8_t* codes, bool mxfp4) {
  return scales16(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))),
                  mxfp4);
}

}  // namespace metrale::cpu::w4a16::detail
