// The decode route on processors with AVX-512 BF16: E2M1 codes looked up as BF16 and multiplied
// with BF16 activations by vdpbf16ps, 128 weights per step.
//
// A GEMV streams each weight once, so this kernel has to turn codes into products faster than
// memory delivers them: on the two-core development VM one core must decode about half of the
// machine's read bandwidth. The previous kernel (64 weights per step, ~10 vector operations per
// 64) managed ~16 GB/s per core against ~33 GB/s of bandwidth, so the two largest Llama-3-70B
// layers were compute-bound; this one needs ~8 per 64 and decodes ~22 GB/s per core
// (docs/PERF.md).
//
// Layout of one step. 64 code bytes are loaded as 32 words; word i holds k = 4i..4i+3 (its low
// byte's low then high nibble, then its high byte's). vpermw reads only the low 5 bits of each
// index, so the word itself, and the word shifted right by 4, 8 and 12, look up nibble r = 0..3
// of every word in a 32-entry table (E2M1 as BF16, twice, so the neighbouring nibble's bit that
// lands in bit 4 of the index is harmless). Lookup r holds weight 4i + r in element i. vdpbf16ps
// adds the products of elements 2j and 2j+1 into FP32 lane j, so lane j of the four dot
// products sums k = 8j..8j+7: lanes 2g and 2g+1 are NVFP4 block g of the step (MXFP4 block g is
// lanes 4g..4g+3), and one multiply-add by a vector of block scales finishes the step.
// A is staged to match once per block of columns: element i of its vector r is A[4i + r].
//
// Exactness: E2M1 values and BF16 activations are exact in BF16, so every product is exact in
// FP32 as in the other kernels; vdpbf16ps adds in FP32 with round-to-nearest-even and treats
// subnormal inputs and outputs as zero (below 1.2e-38, far under what the tolerance allows).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "cpu/kernels/decode_bf16.h"
#include "cpu/kernels/step_bf16.h"
#include "cpu/kernels/w4a16_shared.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {
namespace {

constexpr std::int64_t kStep = 128;  // weights per step: 64 code bytes
// Prefetch distances in code bytes, each column's stream being contiguous with the next's: one line
// into L1 a little ahead and one into L2 far ahead. See Note [L2 read-ahead distance] in
// docs/NOTES.md.
constexpr std::int64_t kPrefetchL1 = 2048, kPrefetchL2 = 16384;

// BF16 bits of E2M1 value i & 15 for i < 32.
struct Bf16Lut {
  alignas(64) std::uint16_t words[32];
};
const Bf16Lut& bf16_lut() {
  static const Bf16Lut lut = [] {
    Bf16Lut x{};
    for (int i = 0; i < 32; ++i) x.words[i] = num::f32_to_bf16(num::e2m1_to_f32(i & 15));
    return x;
  }();
  return lut;
}

// 16 E4M3 block scales as FP32 times 2^-8. The byte is moved into an FP16 with its sign at bit
// 15 and its 7 magnitude bits at 13..7: E4M3 (bias 7) there is the same value times 2^-8,
// subnormals included. The factor is taken out of the column's sum at the end (an exact power of
// two), and the NaN codes, which land on finite FP16s here, are looked for once per column
// (has_e4m3_nan): five operations per 16 scales instead of eight, worth ~9% of the kernel's
// rate from L3.
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline __m512 e4m3x16_over_256(
    const std::uint8_t* s) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m256i high = _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);  // byte in bits 15..8
  // An arithmetic shift by one keeps the sign at bit 15 and copies it into bit 14, cleared next.
  const __m256i half = _mm256_and_si256(_mm256_srai_epi16(high, 1), _mm256_set1_epi16(-0x4001));
  return _mm512_cvtph_ps(half);
}

// Whether any of `count` E4M3 codes is a NaN (0x7F or 0xFF).
[[METRALE_TARGET_AVX512BF16]] bool has_e4m3_nan(const std::uint8_t* s, std::int64_t count) {
  const __m512i mag = _mm512_set1_epi8(0x7F);
  __mmask64 nan = 0;
  for (std::int64_t i = 0; i < count; i += 64) {
    const __mmask64 live = count - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (count - i)) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(live, s + i);
    nan |= _mm512_mask_cmpeq_epi8_mask(live, _mm512_and_si512(v, mag), mag);
  }
  return nan != 0;
}

// 16 E8M0 block scales as FP32: 2^(e-127), with 0 as the float subnormal 2^-127 and 255 as NaN
// (num::e8m0_to_f32).
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline __m512 e8m0x16(const std::uint8_t* s) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  __m512i bits = _mm512_slli_epi32(e, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                               _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                               _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(bits);
}

// A as BF16 in step-major order: step c of row m at (c * MB + m) * 128, as four vectors of 32
// (vector r: A[4i + r]), so the rows one step needs share cache lines. Rows past M are zero.
// Two permutes and an insert per vector: a scalar reorder cost up to a fifth of a block's time
// at K = 28672 (it runs once per block of columns).
template <int MB>
[[METRALE_TARGET_AVX512BF16]] const std::uint16_t* stage_a(const GemmParams& p,
                                                           std::int64_t steps) {
  thread_local std::vector<std::uint16_t> staged;
  staged.resize(static_cast<std::size_t>(steps * MB * kStep));
  const auto* a16 = at<const std::uint16_t>(p.a);
  __m512i every4th[4];
  every4th_indices(every4th);
  for (std::int64_t m = 0; m < MB; ++m) {
    for (std::int64_t c = 0; c < steps; ++c) {
      std::uint16_t* dst = &staged[static_cast<std::size_t>((c * MB + m) * kStep)];
      if (m >= p.m) {
        std::memset(dst, 0, kStep * 2);
        continue;
      }
      const std::uint16_t* src = a16 + m * p.k + c * kStep;
      stage_step(src, dst, every4th);
    }
  }
  return staged.data();
}

template <int MB>
[[METRALE_TARGET_AVX512BF16]] void decode_rows(const GemmParams& p, std::int64_t n0,
                                               std::int64_t n1) {
  // Two accumulators per column for one row, so its multiply-add chain never waits on itself.
  constexpr int P = MB >= 2 ? 1 : 2;
  const Weights w(p);
  const std::int64_t kv = p.k / kStep * kStep, steps = kv / kStep;
  const std::int64_t kb = p.k / 2, groups = p.k / w.group;
  const std::uint16_t* a = stage_a<MB>(p, steps);
  const __m512i lut = _mm512_load_si512(bf16_lut().words);
  // Which of 16 decoded scales each lane takes in step b of a batch: NVFP4 lanes 2g, 2g+1 take
  // scale 8b + g (two steps per 16 scales); MXFP4 lanes 4g..4g+3 take 4b + g (four steps).
  const int batch = w.mxfp4 ? 4 : 2;
  __m512i pick[4];
  for (int b = 0; b < batch; ++b) {
    alignas(64) std::int32_t idx[16];
    for (int l = 0; l < 16; ++l) idx[l] = 16 / batch * b + l / (w.mxfp4 ? 4 : 2);
    pick[b] = _mm512_load_si512(idx);
  }
  auto scales16 = [&](const std::uint8_t* s)
      __attribute__((always_inline, target(METRALE_AVX512BF16_FEATURES))) {
    return w.mxfp4 ? e8m0x16(s) : e4m3x16_over_256(s);
  };
  const std::int64_t scales_per_step = kStep / w.group;
  const float unscale = w.mxfp4 ? 1.0f : 256.0f;  // see e4m3x16_over_256

  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* codes = w.codes + n * kb;
    const std::uint8_t* scales = w.scales + n * groups;
    __m512 acc[MB][P];
    for (int m = 0; m < MB; ++m) {
      for (int q = 0; q < P; ++q) acc[m][q] = _mm512_setzero_ps();
    }
    auto step = [&](std::int64_t c, int q, __m512 scale)
        __attribute__((always_inline, target(METRALE_AVX512BF16_FEATURES))) {
      // Each column's codes follow the previous column's, so reading ahead runs on into the
      // next column (or the next block; prefetches never fault).
      _mm_prefetch(reinterpret_cast<const char*>(codes + c * 64 + kPrefetchL1), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(codes + c * 64 + kPrefetchL2), _MM_HINT_T1);
      const StepWeights ws = lookup_step(codes + c * 64, lut);
      const std::uint16_t* ac = a + c * MB * kStep;
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const std::uint16_t* am = ac + m * kStep;
        const __m512 dot = dot_step(ws, am);
        acc[m][q] = _mm512_fmadd_ps(dot, scale, acc[m][q]);
      }
    };
    std::int64_t c = 0;
    for (; c + batch <= steps; c += batch) {
      const __m512 s16 = scales16(scales + c * scales_per_step);
#pragma GCC unroll 4
      for (int b = 0; b < batch; ++b) {
        step(c + b, b % P, _mm512_permutexvar_ps(pick[b], s16));
      }
    }
    for (; c < steps; ++c) {  // the last steps that do not fill a batch of 16 scales
      alignas(16) std::uint8_t part[16] = {};
      std::memcpy(part, scales + c * scales_per_step, static_cast<std::size_t>(scales_per_step));
      step(c, 0, _mm512_permutexvar_ps(pick[0], scales16(part)));
    }
    const bool nan_scale = !w.mxfp4 && has_e4m3_nan(scales, steps * scales_per_step);
    for (std::int64_t m = 0; m < p.m; ++m) {
      __m512 total = acc[m][0];
      for (int q = 1; q < P; ++q) total = _mm512_add_ps(total, acc[m][q]);
      const float sum = nan_scale ? __builtin_nanf("") : _mm512_reduce_add_ps(total) * unscale;
      finish_row(p, w, m, n, kv, sum);
    }
  }
}

}  // namespace

// The entry point carries no target attribute (GCC would treat one that differs from the
// header's declaration as another version of the function); the body it calls does.
template <int MB>
void decode_rows_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  decode_rows<MB>(p, n0, n1);
}

template void decode_rows_bf16<1>(const GemmParams&, std::int64_t, std::int64_t);
template void decode_rows_bf16<2>(const GemmParams&, std::int64_t, std::int64_t);
template void decode_rows_bf16<4>(const GemmParams&, std::int64_t, std::int64_t);
template void decode_rows_bf16<8>(const GemmParams&, std::int64_t, std::int64_t);
template void decode_rows_bf16<16>(const GemmParams&, std::int64_t, std::int64_t);

}  // namespace metrale::cpu::w4a16::detail
