// The decode route on processors with AVX2 (and FMA, F16C) but no AVX-512 BF16: E2M1 codes
// looked up as BF16 bytes 32 at a time, widened to FP32 without a multiply, and multiplied with
// FP32 activations, 64 weights per step.
//
// A GEMV streams each weight once, so the loop must decode faster than memory delivers: on the
// two-core development VM (Zen 3 at ~2.9 GHz, 21-25 GB/s) one core has about 10 cycles for a
// step's 36 bytes at 85% of the bandwidth. The previous kernel looked each weight up with vpermps
// (8 lanes per instruction, the sign moved in by four more, a scalar scale look-up per 16) and
// ran ~110 instructions per 64 weights, 72 of them vector; this one runs ~42, 34 vector (objdump
// of the one-row loop). See Note [AVX2 decode budget] in docs/NOTES.md.
//
// Layout of one step. The 32 code bytes' low nibbles and high nibbles (k = 2j and 2j + 1 of byte
// j) index two 16-entry byte tables with vpshufb: the low and the high byte of the weight as
// BF16, sign included. vpunpck{l,h}bw pair them into BF16 words (bytes 0-7 and 8-15 of each
// 128-bit half), and each dword's two words become two FP32 vectors: the high word by masking
// the low one off, the low word by shifting it up. So vector v = 4x + 2h + e (x: which nibble, h:
// which 8 bytes of a half, e: the word's parity) holds, in lane l = 4L + i, the weight of byte
// j = 16L + 8h + 2i + e: lanes 0-3 are NVFP4 block h of the step and lanes 4-7 block 2 + h (MXFP4
// block L in both). A is staged in that order once per block of columns.
//
// Exactness: E2M1 values and BF16 activations are exact in FP32 and so are their products, as in
// the other kernels. NVFP4 scales (E4M3, decoded through F16C as the value times 2^-8) multiply
// each block's sum at one row and the weights at more rows, where E2M1 x E4M3 is exact; MXFP4
// scales always multiply block sums, since E8M0's extremes would take the weights' products below
// the normal range or past the largest float.
#include "cpu/kernels/decode_avx2.h"

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "cpu/kernels/step_avx2.h"
#include "cpu/kernels/w4a16_shared.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"

#define METRALE_AVX2_FEATURES "avx2,fma,f16c"
#define METRALE_TARGET_AVX2F gnu::target(METRALE_AVX2_FEATURES)

namespace metrale::cpu::w4a16::detail {
namespace {

using avx2_step::decode_half;
using avx2_step::Half;
using avx2_step::kOrder;
using avx2_step::kPrefetchL1;
using avx2_step::kPrefetchL2;
using avx2_step::kStep;

// The low and high bytes of E2M1 code c as BF16 (avx2_step::ByteTables).
const avx2_step::ByteTables& byte_tables() {
  static const avx2_step::ByteTables t =
      avx2_step::byte_tables_of([](int c) { return tables().e2m1_bf16[c]; });
  return t;
}

// A as FP32, step-major: step c of row m at (c * MB + m) * 64 in kOrder, so the rows one step
// reads share cache lines. Rows past M are zero.
template <int MB>
const float* stage_a(const GemmParams& p, std::int64_t steps) {
  thread_local std::vector<float> staged;
  staged.assign(static_cast<std::size_t>(steps * MB * kStep), 0.0f);
  const auto* a16 = at<const std::uint16_t>(p.a);
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t c = 0; c < steps; ++c) {
      float* dst = &staged[static_cast<std::size_t>((c * MB + m) * kStep)];
      const std::uint16_t* src = a16 + m * p.k + c * kStep;
      for (int i = 0; i < kStep; ++i) dst[i] = num::bf16_to_f32(src[kOrder.k[i]]);
    }
  }
  return staged.data();
}

// Eight block scales as FP32: E8M0 as 2^(e-127) (0 the subnormal 2^-127, 255 NaN, as
// num::e8m0_to_f32); E4M3 times 2^-8, the byte moved into an FP16's sign and magnitude bits and
// widened by F16C (decode_bf16.cpp has the derivation). The E4M3 NaN codes land on finite values
// there and are looked for once per column (has_e4m3_nan).
template <bool Mx>
[[METRALE_TARGET_AVX2F, gnu::always_inline]] inline __m256 scales8(const std::uint8_t* s) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  if constexpr (Mx) {
    const __m256i e = _mm256_cvtepu8_epi32(raw);
    __m256i bits = _mm256_slli_epi32(e, 23);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000),
                              _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000),
                              _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(bits);
  } else {
    const __m128i high = _mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8);
    return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(-0x4001)));
  }
}

// Whether any of `count` E4M3 codes is a NaN (0x7F or 0xFF).
[[METRALE_TARGET_AVX2F]] bool has_e4m3_nan(const std::uint8_t* s, std::int64_t count) {
  const __m256i mag = _mm256_set1_epi8(0x7F);
  __m256i nan = _mm256_setzero_si256();
  std::int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_and_si256(v, mag), mag));
  }
  bool any = _mm256_movemask_epi8(nan) != 0;
  for (; i < count; ++i) any = any || (s[i] & 0x7F) == 0x7F;
  return any;
}

template <bool Mx, int MB>
[[METRALE_TARGET_AVX2F]] void decode_rows(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  // Steps per eight scales: NVFP4 has four blocks per step, MXFP4 two.
  constexpr int kBatch = Mx ? 4 : 2;
  constexpr std::int64_t kScalesPerStep = Mx ? 2 : 4;
  // Accumulators per row: one row keeps vectors h = 0 and 1 apart, NVFP4 past one row the two
  // nibble halves; MXFP4 past one row needs one (its scale is the same for both).
  constexpr int J = Mx && MB > 1 ? 1 : 2;
  const Weights w(p);
  const std::int64_t kv = p.k / kStep * kStep, steps = kv / kStep;
  const std::int64_t kb = p.k / 2, groups = p.k / w.group;
  const float* a = stage_a<MB>(p, steps);
  const __m256i low_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(byte_tables().low));
  const __m256i high_table =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(byte_tables().high));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // Which of the eight scales each lane takes in step b of a batch, for h = 0 and 1.
  __m256i pick[kBatch][2];
  for (int b = 0; b < kBatch; ++b) {
    for (int h = 0; h < 2; ++h) {
      alignas(32) std::int32_t idx[8];
      for (int l = 0; l < 8; ++l) idx[l] = Mx ? 2 * b + l / 4 : 4 * b + 2 * (l / 4) + h;
      pick[b][h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    }
  }
  const float unscale = Mx ? 1.0f : 256.0f;  // see scales8

  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* codes = w.codes + n * kb;
    const std::uint8_t* scales = w.scales + n * groups;
    __m256 acc[MB][J];
    for (int m = 0; m < MB; ++m) {
      for (int j = 0; j < J; ++j) acc[m][j] = _mm256_setzero_ps();
    }
    auto step = [&](std::int64_t c, __m256 s0, __m256 s1)
        __attribute__((always_inline, target(METRALE_AVX2_FEATURES))) {
      if ((c & 1) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + c * 32 + kPrefetchL1), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(codes + c * 32 + kPrefetchL2), _MM_HINT_T1);
      }
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 32));
      const __m256i nib[2] = {_mm256_and_si256(v, low4),
                              _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
      const float* ac = a + c * MB * kStep;
      if constexpr (Mx && MB > 1) {
        // One block sum per row and 128-bit half, then its scale.
        __m256 t[MB];
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x) {
          const Half f = decode_half(nib[x], low_table, high_table);
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m) {
            const float* am = ac + m * kStep + 32 * x;
            __m256 s = x == 0 ? _mm256_mul_ps(f.f[0], _mm256_loadu_ps(am))
                              : _mm256_fmadd_ps(f.f[0], _mm256_loadu_ps(am), t[m]);
            s = _mm256_fmadd_ps(f.f[1], _mm256_loadu_ps(am + 8), s);
            s = _mm256_fmadd_ps(f.f[2], _mm256_loadu_ps(am + 16), s);
            t[m] = _mm256_fmadd_ps(f.f[3], _mm256_loadu_ps(am + 24), s);
          }
        }
#pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) acc[m][0] = _mm256_fmadd_ps(t[m], s0, acc[m][0]);
      } else if constexpr (MB == 1) {
        // One row: the sums of vectors h = 0 and 1 (NVFP4's blocks h and 2 + h; for MXFP4 two
        // shorter chains than one), then their scales.
        __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x) {
          const Half f = decode_half(nib[x], low_table, high_table);
          const float* am = ac + 32 * x;
          t0 = x == 0 ? _mm256_mul_ps(f.f[0], _mm256_loadu_ps(am))
                      : _mm256_fmadd_ps(f.f[0], _mm256_loadu_ps(am), t0);
          t0 = _mm256_fmadd_ps(f.f[1], _mm256_loadu_ps(am + 8), t0);
          t1 = x == 0 ? _mm256_mul_ps(f.f[2], _mm256_loadu_ps(am + 16))
                      : _mm256_fmadd_ps(f.f[2], _mm256_loadu_ps(am + 16), t1);
          t1 = _mm256_fmadd_ps(f.f[3], _mm256_loadu_ps(am + 24), t1);
        }
        if constexpr (Mx) {
          // One scale for both: the add runs on an adder pipe, not a multiply-add one.
          acc[0][0] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), s0, acc[0][0]);
        } else {
          acc[0][0] = _mm256_fmadd_ps(t0, s0, acc[0][0]);
          acc[0][1] = _mm256_fmadd_ps(t1, s1, acc[0][1]);
        }
      } else {
        // More rows: the weights scaled once (E2M1 x E4M3 is exact), then one multiply-add per
        // row and vector, nibble half x into accumulator x.
#pragma GCC unroll 2
        for (int x = 0; x < 2; ++x) {
          const Half f = decode_half(nib[x], low_table, high_table);
          const __m256 g[4] = {_mm256_mul_ps(f.f[0], s0), _mm256_mul_ps(f.f[1], s0),
                               _mm256_mul_ps(f.f[2], s1), _mm256_mul_ps(f.f[3], s1)};
#pragma GCC unroll 4
          for (int m = 0; m < MB; ++m) {
            const float* am = ac + m * kStep + 32 * x;
            __m256 s = acc[m][x];
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) s = _mm256_fmadd_ps(g[i], _mm256_loadu_ps(am + 8 * i), s);
            acc[m][x] = s;
          }
        }
      }
    };
    // Step c with the scales of its blocks h = 0 and 1 picked from the batch's eight (one pick
    // for MXFP4, whose two are the same).
    auto step_scaled = [&](std::int64_t c, __m256 s8, const __m256i* picks)
        __attribute__((always_inline, target(METRALE_AVX2_FEATURES))) {
      const __m256 s0 = _mm256_permutevar8x32_ps(s8, picks[0]);
      step(c, s0, Mx ? s0 : _mm256_permutevar8x32_ps(s8, picks[1]));
    };
    std::int64_t c = 0;
    for (; c + kBatch <= steps; c += kBatch) {
      const __m256 s8 = scales8<Mx>(scales + c * kScalesPerStep);
#pragma GCC unroll 4
      for (int b = 0; b < kBatch; ++b) {
        step_scaled(c + b, s8, pick[b]);
      }
    }
    if (c < steps) {  // the last steps, which do not fill a batch of eight scales
      alignas(16) std::uint8_t part[16] = {};
      std::memcpy(part, scales + c * kScalesPerStep,
                  static_cast<std::size_t>((steps - c) * kScalesPerStep));
      const __m256 s8 = scales8<Mx>(part);
      for (int b = 0; c + b < steps; ++b) {
        step_scaled(c + b, s8, pick[b]);
      }
    }
    const bool nan_scale = !Mx && has_e4m3_nan(scales, steps * kScalesPerStep);
    for (std::int64_t m = 0; m < p.m; ++m) {
      __m256 total = acc[m][0];
      for (int j = 1; j < J; ++j) total = _mm256_add_ps(total, acc[m][j]);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, total);
      float sum = 0.0f;
      for (float l : lanes) sum += l;
      finish_row(p, w, m, n, kv, nan_scale ? __builtin_nanf("") : sum * unscale);
    }
  }
}

}  // namespace

// The entry point carries no target attribute (see decode_bf16.cpp); the bodies it calls do.
template <int MB>
void decode_rows_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  if (p.flags & kGemmMxfp4) {
    decode_rows<true, MB>(p, n0, n1);
  } else {
    decode_rows<false, MB>(p, n0, n1);
  }
}

template void decode_rows_avx2<1>(const GemmParams&, std::int64_t, std::int64_t);
template void decode_rows_avx2<2>(const GemmParams&, std::int64_t, std::int64_t);
template void decode_rows_avx2<4>(const GemmParams&, std::int64_t, std::int64_t);

}  // namespace metrale::cpu::w4a16::detail
