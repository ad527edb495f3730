// INT4 weights on processors with AVX-512 BF16: codes looked up as the BF16 values code − 8 and
// multiplied with BF16 activations by vdpbf16ps, 128 weights per step, the layout of
// decode_bf16.cpp (word i of a step's 64 code bytes holds k = 4i..4i+3; lookup r holds weight
// 4i + r in element i; lane j of the four dot products sums k = 8j..8j+7, one group's).
//
// Scales and zero points: W = (code − zero)·s = (code − 8)·s + (8 − zero)·s, so each lane adds
// dot·s per step and, for asymmetric weights, the column adds Σ_g (8 − zero_g)·s_g·Σa_g over its
// groups, sixteen groups per multiply-add, with each group's Σa (in FP32) staged with A once per
// block of columns. Both products are exact in FP32 ((code − 8) and BF16 a, 4 + 8 bits;
// (8 − zero)·s, 5 + 11); the sums round as the tolerance derives for INT4
// (toolkit/gemm_tolerance.h: its roundings scale with Σ|a|·(|code − 8| + |8 − zero|)·s).
//
// Groups of 32 and 64 split a step into 4 or 2 (16 scales serve 4 or 8 steps, picked per lane as
// decode_bf16.cpp picks MXFP4's); a group of 128 or more is one scale per step, broadcast.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/kernels/int4_cpu.h"
#include "cpu/kernels/int4_shared.h"
#include "cpu/kernels/step_bf16.h"
#include "cpu/kernels/w4a16_shared.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {
namespace {

constexpr std::int64_t kStep = 128;  // weights per step: 64 code bytes
// Prefetch distances in code bytes, as decode_bf16.cpp (Note [L2 read-ahead distance]).
constexpr std::int64_t kPrefetchL1 = 2048, kPrefetchL2 = 16384;

// `count` (at most 16) scales from s as FP32; lanes past count are 0.
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline __m512 scales16(const std::uint8_t* s,
                                                                         std::int64_t count,
                                                                         bool fp16) {
  const auto live = static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
  const __m256i raw = _mm256_maskz_loadu_epi16(live, s);
  return fp16 ? _mm512_cvtph_ps(raw)
              : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// `count` (at most 16) zero points from z as 8 − zero in FP32; lanes past count are 8.
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline __m512 offsets16(const std::uint8_t* z,
                                                                          std::int64_t count) {
  const auto live = static_cast<__mmask16>(count >= 16 ? 0xFFFF : (1u << count) - 1);
  const __m512i zero = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, z));
  return _mm512_sub_ps(_mm512_set1_ps(8.0f), _mm512_cvtepi32_ps(zero));
}

// A as BF16 in step-major order, as decode_bf16.cpp stages it (step c of row m at
// (c * MB + m) * 128; vector r of a step holds A[4i + r]; in the stored order already under act
// order); rows past M are zero. With `sums`, also each group's Σa over the staged steps
// (row m's group g at m * padded + g, `padded` the groups rounded up to 16, zero beyond).
template <int MB>
[[METRALE_TARGET_AVX512BF16]] const std::uint16_t* stage_a(const GemmParams& p,
                                                           const Int4Weights& w, std::int64_t steps,
                                                           bool sums, std::int64_t padded,
                                                           const float** group_sums) {
  thread_local std::vector<std::uint16_t> staged;
  thread_local std::vector<float> sum;
  staged.assign(static_cast<std::size_t>(steps * MB * kStep), 0);
  if (sums) sum.assign(static_cast<std::size_t>(MB * padded), 0.0f);
  const auto* a16 = at<const std::uint16_t>(p.a);
  __m512i every4th[4];
  every4th_indices(every4th);
  for (std::int64_t m = 0; m < std::min<std::int64_t>(MB, p.m); ++m) {
    const std::uint16_t* src = a16 + m * p.k;
    for (std::int64_t c = 0; c < steps; ++c) {
      const std::uint16_t* s = src + c * kStep;
      std::uint16_t* dst = &staged[static_cast<std::size_t>((c * MB + m) * kStep)];
      stage_step(s, dst, every4th);
    }
    if (sums) {
      // Sixteen at a time (a scalar loop with a division per element cost more than the steps it
      // serves at M = 1); a group's span in the staged steps is a multiple of 32.
      float* gs = &sum[static_cast<std::size_t>(m * padded)];
      const std::int64_t kv = steps * kStep;
      for (std::int64_t j0 = 0, g = 0; j0 < kv; j0 += w.group, ++g) {
        __m512 t = _mm512_setzero_ps();
        for (std::int64_t j = j0; j < std::min(kv, j0 + w.group); j += 16) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
          t = _mm512_add_ps(t,
                            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        gs[g] = _mm512_reduce_add_ps(t);
      }
    }
  }
  *group_sums = sum.data();
  return staged.data();
}

template <int MB>
[[METRALE_TARGET_AVX512BF16]] void rows(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  // Two accumulators per column for one row, so its multiply-add chain never waits on itself.
  constexpr int P = MB >= 2 ? 1 : 2;
  const Int4Weights w(p);
  const bool zp = w.zeros != nullptr;
  const std::int64_t steps = p.k / kStep, kv = steps * kStep;
  const std::int64_t padded = (w.groups + 15) / 16 * 16;
  const float* sums = nullptr;
  const std::uint16_t* a = stage_a<MB>(p, w, steps, zp, padded, &sums);
  const __m512i lut = _mm512_load_si512(int4_bf16_lut().words);
  // Groups of 32 or 64: `batch` steps share 16 scales; lane l of step b takes scale
  // b·(128 / group) + 8l / group of them.
  // (One scale per row with K below 128 has no whole step: the scalar tail takes all of it.)
  const bool small = w.group == 32 || w.group == 64;
  const std::int64_t per_step = small ? kStep / w.group : 0;
  const int batch = small ? static_cast<int>(16 / per_step) : 1;
  __m512i pick[8];
  for (int b = 0; b < batch; ++b) {
    alignas(64) std::int32_t idx[16];
    for (int l = 0; l < 16; ++l) {
      idx[l] = small ? static_cast<std::int32_t>(b * per_step + 8 * l / w.group) : 0;
    }
    pick[b] = _mm512_load_si512(idx);
  }
  // Groups of 128 or more: steps per group (one scale per row: every step).
  const std::int64_t per_group = small ? 0 : w.group % kStep == 0 ? w.group / kStep : steps;
  thread_local std::vector<float> decoded;
  decoded.resize(static_cast<std::size_t>(padded));
  float* row_scales = decoded.data();

  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* codes = w.codes + n * (p.k / 2);
    const std::uint8_t* scales = w.scales + 2 * n * w.groups;
    const std::uint8_t* zeros = zp ? w.zeros + n * w.groups : nullptr;
    __m512 acc[MB][P], offsets[MB];
    for (int m = 0; m < MB; ++m) {
      for (int q = 0; q < P; ++q) acc[m][q] = _mm512_setzero_ps();
      offsets[m] = _mm512_setzero_ps();
    }
    // 16 groups' scales from g0, and their zero points' term: Σ over the groups of
    // (8 − zero)·s·Σa, one multiply-add per 16 groups and row.
    auto groups16 = [&](std::int64_t g0)
        __attribute__((always_inline, target(METRALE_AVX512BF16_FEATURES))) {
      const std::int64_t count = std::min<std::int64_t>(16, w.groups - g0);
      const __m512 s16 = scales16(scales + 2 * g0, count, w.fp16);
      if (zp) {
        const __m512 o16 = _mm512_mul_ps(offsets16(zeros + g0, count), s16);
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m) {
          offsets[m] = _mm512_fmadd_ps(o16, _mm512_loadu_ps(sums + m * padded + g0), offsets[m]);
        }
      }
      return s16;
    };
    auto step = [&](std::int64_t c, int q, __m512 scale)
        __attribute__((always_inline, target(METRALE_AVX512BF16_FEATURES))) {
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
    if (small) {
      // A batch's 16 scales are its groups' own: `batch` steps of 128 / group groups each.
      std::int64_t c = 0;
      for (; c + batch <= steps; c += batch) {
        const __m512 s16 = groups16(c * per_step);
#pragma GCC unroll 8
        for (int b = 0; b < batch; ++b) step(c + b, b % P, _mm512_permutexvar_ps(pick[b], s16));
      }
      if (c < steps) {
        const __m512 s16 = groups16(c * per_step);
        for (int b = 0; c + b < steps; ++b) step(c + b, 0, _mm512_permutexvar_ps(pick[b], s16));
      }
    } else {
      // The row's scales decoded sixteen at a time, then one broadcast per group (decoding each
      // step's scale alone cost a fifth of the step at M = 1).
      for (std::int64_t g0 = 0; g0 < w.groups; g0 += 16)
        _mm512_storeu_ps(row_scales + g0, groups16(g0));
      for (std::int64_t c0 = 0, g = 0; c0 < steps; c0 += per_group, ++g) {
        const __m512 scale = _mm512_set1_ps(row_scales[g]);
        const std::int64_t c1 = std::min(steps, c0 + per_group);
        // Two steps at a time, so the accumulator each takes is known at compile time (a
        // run-time index kept them in memory).
        std::int64_t c = c0;
        for (; c + 2 <= c1; c += 2) {
          step(c, 0, scale);
          step(c + 1, 1 % P, scale);
        }
        if (c < c1) step(c, 0, scale);
      }
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      __m512 total = _mm512_add_ps(acc[m][0], offsets[m]);
      for (int q = 1; q < P; ++q) total = _mm512_add_ps(total, acc[m][q]);
      float sum = _mm512_reduce_add_ps(total);
      // The columns past the last whole step (K not a multiple of 128: whole groups of 32 or 64,
      // or the end of a per-row group), exactly as the portable kernel takes them.
      for (std::int64_t j = kv; j < p.k; ++j) {
        const std::int64_t g = j / w.group;
        sum += a_at(p, m, j) * static_cast<float>(w.code(n, j) - w.zero(n, g)) * w.scale(n, g);
      }
      store(p, m, n, sum);
    }
  }
}

}  // namespace

// The entry point carries no target attribute (see decode_bf16.cpp).
template <int MB>
void int4_rows_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  rows<MB>(p, n0, n1);
}

template void int4_rows_bf16<1>(const GemmParams&, std::int64_t, std::int64_t);
template void int4_rows_bf16<2>(const GemmParams&, std::int64_t, std::int64_t);
template void int4_rows_bf16<4>(const GemmParams&, std::int64_t, std::int64_t);
template void int4_rows_bf16<8>(const GemmParams&, std::int64_t, std::int64_t);
template void int4_rows_bf16<16>(const GemmParams&, std::int64_t, std::int64_t);

}  // namespace metrale::cpu::w4a16::detail
