// The W8A8 op's activation cast with AVX-512 (fp8_cpu.h): per 128-K block the amax over vectors
// of 16, one FP32 division of each element by the block's scale, and f32_to_e4m3's rounding done
// on the quotients' bits (numerics.h), so the codes are the scalar kernel's. It was a sixth of a
// grouped FP8 prefill's time on the CPU element by element (docs/PERF.md).
#include <immintrin.h>

#include <algorithm>
#include <cstddef>

#include "cpu/kernels/fp8_cpu.h"

// Vector arguments of always-inlined helpers (-Wpsabi), and GCC 12's _mm512_reduce_max_ps, whose
// header leaves a lane "maybe uninitialized", as in the other AVX-512 kernels.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::fp8 {
namespace {

#define METRALE_CAST_TARGET gnu::target("avx512f,avx512bw,avx512vl,avx512dq")

// The E4M3 codes of 16 floats (f32_to_e4m3): a normal quotient keeps 3 mantissa bits, rounded to
// nearest even by adding 0x7FFFF plus the kept bit's value to the 20 dropped ones (a carry moves
// into the exponent, as rounding up should), its exponent rebiased from 127 to 7 and the code
// capped at 0x7E (448: larger values, infinity and values rounding past 448 saturate); below
// 2^-6 the code is |q|·2^9 rounded to the nearest even integer (0..8, where 8 is the smallest
// normal's code); NaN is 0x7F; the sign is bit 7 in every case.
[[METRALE_CAST_TARGET, gnu::always_inline]] inline __m128i encode16(__m512 q) {
  const __m512i u = _mm512_castps_si512(q);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i kept = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), kept), 20);
  __m512i code = _mm512_min_epi32(_mm512_sub_epi32(rounded, _mm512_set1_epi32(120 << 3)),
                                  _mm512_set1_epi32(0x7E));
  const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3C800000));
  const __m512 grid = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f));
  code = _mm512_mask_mov_epi32(
      code, small, _mm512_cvt_roundps_epi32(grid, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
}

// 16 BF16 values (lanes past `live` zero) as floats.
[[METRALE_CAST_TARGET, gnu::always_inline]] inline __m512 load16(const std::uint16_t* at,
                                                                 __mmask16 live) {
  const __m256i h = _mm256_maskz_loadu_epi16(live, at);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

[[METRALE_CAST_TARGET, gnu::always_inline]] inline __mmask16 live_of(std::int64_t left) {
  return left >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << left) - 1);
}

}  // namespace

[[METRALE_CAST_TARGET]] void cast_e4m3_block128_avx512(const Fp8CastParams& p, std::int64_t i0,
                                                       std::int64_t i1) {
  namespace f = metrale::fp8;
  const auto* in = reinterpret_cast<const std::uint16_t*>(p.in);
  auto* codes = reinterpret_cast<std::uint8_t*>(p.codes);
  auto* scales = reinterpret_cast<float*>(p.scales);
  const std::int64_t kblocks = (p.k + f::kCastBlock - 1) / f::kCastBlock;
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (std::int64_t i = i0; i < i1; ++i) {
    const std::int64_t m = i / kblocks, kb = i % kblocks;
    const std::int64_t k0 = kb * f::kCastBlock, k1 = std::min(p.k, k0 + f::kCastBlock);
    const std::uint16_t* row = in + m * p.k;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (std::int64_t q = k0; q < k1; q += 16) {
      const __m512 v = _mm512_and_ps(load16(row + q, live_of(k1 - q)), magnitude);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      amax = _mm512_max_ps(amax, v);
    }
    if (nan != 0) {
      cast_e4m3_block128_scalar(p, i, i + 1);  // the scale is the first NaN's, bit for bit
      continue;
    }
    const float s = f::block_scale(_mm512_reduce_max_ps(amax));
    const __m512 sv = _mm512_set1_ps(s);
    for (std::int64_t q = k0; q < k1; q += 16) {
      const __mmask16 live = live_of(k1 - q);
      _mm_mask_storeu_epi8(codes + m * p.k + q, live,
                           encode16(_mm512_div_ps(load16(row + q, live), sv)));
    }
    scales[kb * f::scales_ld(p.m) + m] = s;
  }
}

[[METRALE_CAST_TARGET]] void encode_e4m3_avx512(const float* x, float s, std::uint8_t* out,
                                                std::int64_t n) {
  const __m512 sv = _mm512_set1_ps(s);
  for (std::int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = live_of(n - i);
    _mm_mask_storeu_epi8(out + i, live,
                         encode16(_mm512_div_ps(_mm512_maskz_loadu_ps(live, x + i), sv)));
  }
}

}  // namespace metrale::cpu::fp8
