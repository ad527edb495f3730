// Block scale codes decoded to FP32 in a vector, for the AVX2 kernels (tiled_avx2.cpp): the
// eight-lane form of scales_avx512.h. Internal to src/cpu/kernels; include only from files whose
// functions are compiled for AVX2 (the helper is always inlined into them).
#pragma once

#include <immintrin.h>

namespace metrale::cpu::w4a16::detail {

// Eight scale codes (one per lane, zero-extended) as FP32, as num::e4m3_to_f32 / e8m0_to_f32 give
// them. E4M3: the 7 magnitude bits placed under FP32's exponent field read as 2^-120 times the
// value (subnormals included, FP32 keeps them), so one exact multiply by 2^120 and the sign
// finish it; 0x7F and 0xFF are NaN. E8M0: the code is the exponent; 0 is 2^-127 (an FP32
// subnormal) and 255 NaN.
[[gnu::target("avx2,fma"), gnu::always_inline]] inline __m256 scales8(__m256i code, bool mxfp4) {
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  if (mxfp4) {
    __m256 bits = _mm256_castsi256_ps(_mm256_slli_epi32(code, 23));
    bits = _mm256_blendv_ps(bits, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)),
                            _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, _mm256_setzero_si256())));
    return _mm256_blendv_ps(bits, nan,
                            _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, _mm256_set1_epi32(255))));
  }
  const __m256i mag = _mm256_and_si256(code, _mm256_set1_epi32(0x7F));
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)),
                                     _mm256_castsi256_ps(_mm256_set1_epi32(0x7B800000)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  const __m256 signed_value = _mm256_or_ps(value, _mm256_castsi256_ps(sign));
  return _mm256_blendv_ps(signed_value, nan,
                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
}

}  // namespace metrale::cpu::w4a16::detail
