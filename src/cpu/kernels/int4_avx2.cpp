// INT4 weights (Note [INT4 weights]) on processors with AVX2 (FMA, F16C) but no AVX-512 BF16: the
// FP4 AVX2 decode kernel's step (decode_avx2.cpp) with another table. A step is 64 weights, 32
// code bytes: their low and high nibbles index two 16-entry byte tables with vpshufb, the low and
// the high byte of code − 8 as BF16 (exact: −8..7), paired into BF16 words and widened to FP32
// without a multiply. Each row's sum of a·(code − 8) per 32-K half-step (lanes 0-3 hold K 0-31 of
// the step, lanes 4-7 K 32-63, in decode_avx2.cpp's order) is multiplied by its group's scale
// (groups of 32 take two scales a step; larger groups one), and the zero point's term
// Σa·(8 − zero)·scale is added per group from each row's Σa staged with A. K past the last whole
// step goes through the scalar tail. Products are exact in FP32, as in the other kernels; the
// sums round relative to Σ|a|·(|q − 8| + |8 − z|)·s (toolkit/gemm_tolerance.h, "INT4").
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu/kernels/int4_cpu.h"
#include "cpu/kernels/int4_shared.h"
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

// The low and high bytes of code − 8 as BF16 (exact: −8..7).
const avx2_step::ByteTables& byte_tables() {
  static const avx2_step::ByteTables t =
      avx2_step::byte_tables_of([](int c) { return num::f32_to_bf16(static_cast<float>(c - 8)); });
  return t;
}

// A as FP32 (in the stored K order already under act order), step-major: step c of
// row m at (c * MB + m) * 64 in kOrder; rows past M are zero. sums[m * groups + g]: Σa over the
// whole steps' part of group g, for the zero points' term.
template <int MB>
const float* stage_a(const GemmParams& p, const Int4Weights& w, std::int64_t steps,
                     std::vector<float>& sums) {
  thread_local std::vector<float> staged, row;
  staged.assign(static_cast<std::size_t>(steps * MB * kStep), 0.0f);
  sums.assign(static_cast<std::size_t>(MB * w.groups), 0.0f);
  const std::int64_t kv = steps * kStep;
  row.resize(static_cast<std::size_t>(kv));
  for (std::int64_t m = 0; m < p.m; ++m) {
    // The row in stored order first, and its groups' sums group by group (a division per element
    // cost as much as the weights' own decode in the AVX-512 kernel: docs/PERF.md, INT4).
    for (std::int64_t j = 0; j < kv; ++j) row[static_cast<std::size_t>(j)] = a_at(p, m, j);
    float* sm = sums.data() + m * w.groups;
    for (std::int64_t g0 = 0, g = 0; g0 < kv; g0 += w.group, ++g) {
      float s = 0.0f;
      for (std::int64_t j = g0; j < std::min(kv, g0 + w.group); ++j) s += row[j];
      sm[g] = s;
    }
    for (std::int64_t c = 0; c < steps; ++c) {
      float* dst = &staged[static_cast<std::size_t>((c * MB + m) * kStep)];
      const float* src = row.data() + c * kStep;
      for (int i = 0; i < kStep; ++i) dst[i] = src[kOrder.k[i]];
    }
  }
  return staged.data();
}

// Row n's scales as floats: FP16 eight at a time by F16C (a software conversion per group cost a
// quarter of the decode at groups of 128), BF16 by a shift.
[[METRALE_TARGET_AVX2F]] void row_scales_f32(const Int4Weights& w, std::int64_t n, float* out) {
  const std::uint8_t* s = w.scales + 2 * n * w.groups;
  std::int64_t g = 0;
  for (; g + 8 <= w.groups; g += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * g));
    const __m256 f = w.fp16 ? _mm256_cvtph_ps(h)
                            : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    _mm256_storeu_ps(out + g, f);
  }
  for (; g < w.groups; ++g) out[g] = w.scale(n, g);
}

// Σ over the groups that start below kv of sums[g]·(8 − zero(n, g))·scales[g].
[[METRALE_TARGET_AVX2F]] float zero_term(const Int4Weights& w, std::int64_t n, const float* sums,
                                         const std::vector<float>& scales, std::int64_t kv) {
  const std::int64_t groups = (kv + w.group - 1) / w.group;
  const std::uint8_t* z = w.zeros + n * w.groups;
  __m256 acc = _mm256_setzero_ps();
  std::int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + g));
    const __m256 eight_minus =
        _mm256_sub_ps(_mm256_set1_ps(8.0f), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(sums + g), eight_minus),
                          _mm256_loadu_ps(scales.data() + g), acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float total = 0.0f;
  for (const float l : lanes) total += l;
  for (; g < groups; ++g) {
    total += sums[g] * static_cast<float>(8 - z[g]) * scales[static_cast<std::size_t>(g)];
  }
  return total;
}

template <int MB>
[[METRALE_TARGET_AVX2F]] void int4_rows(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Int4Weights w(p);
  const std::int64_t kv = p.k / kStep * kStep, steps = kv / kStep, kb = p.k / 2;
  thread_local std::vector<float> sums;
  const float* a = stage_a<MB>(p, w, steps, sums);
  const __m256i low_table = _mm256_load_si256(reinterpret_cast<const __m256i*>(byte_tables().low));
  const __m256i high_table =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(byte_tables().high));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  thread_local std::vector<float> row_scales;
  row_scales.resize(static_cast<std::size_t>(w.groups));
  // Steps per scale for groups of 64 and more (a group of K not a multiple of 64 covers every
  // whole step); groups of 32 take two scales a step.
  const std::int64_t per_scale = w.group == 32 ? 0 : std::max<std::int64_t>(1, w.group / kStep);
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* codes = w.codes + n * kb;
    // The row's scales as floats once, so a step loads them instead of converting FP16.
    row_scales_f32(w, n, row_scales.data());
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    // Step c: its 64 weights times the staged A of each row, scaled per 32-K half by s.
    const auto step = [&](std::int64_t c, __m256 s)
        __attribute__((always_inline, target(METRALE_AVX2_FEATURES))) {
      if ((c & 1) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + c * 32 + kPrefetchL1), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(codes + c * 32 + kPrefetchL2), _MM_HINT_T1);
      }
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 32));
      const Half lo = decode_half(_mm256_and_si256(v, low4), low_table, high_table);
      const Half hi =
          decode_half(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), low_table, high_table);
      const float* ac = a + c * MB * kStep;
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) {
        const float* am = ac + m * kStep;
        __m256 t0 = _mm256_mul_ps(lo.f[0], _mm256_loadu_ps(am));
        __m256 t1 = _mm256_mul_ps(lo.f[2], _mm256_loadu_ps(am + 16));
        t0 = _mm256_fmadd_ps(lo.f[1], _mm256_loadu_ps(am + 8), t0);
        t1 = _mm256_fmadd_ps(lo.f[3], _mm256_loadu_ps(am + 24), t1);
        t0 = _mm256_fmadd_ps(hi.f[0], _mm256_loadu_ps(am + 32), t0);
        t1 = _mm256_fmadd_ps(hi.f[2], _mm256_loadu_ps(am + 48), t1);
        t0 = _mm256_fmadd_ps(hi.f[1], _mm256_loadu_ps(am + 40), t0);
        t1 = _mm256_fmadd_ps(hi.f[3], _mm256_loadu_ps(am + 56), t1);
        acc[m] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), s, acc[m]);
      }
    };
    if (per_scale == 0) {
      // Lanes 0-3 hold the step's first 32 K (group 2 c), lanes 4-7 its last 32 (group 2 c + 1).
      for (std::int64_t c = 0; c < steps; ++c) {
        const __m128 pair =
            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(row_scales.data() + 2 * c)));
        step(c, _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), halves));
      }
    } else {
      for (std::int64_t c = 0, g = 0; c < steps; ++g) {
        const __m256 s = _mm256_set1_ps(row_scales[static_cast<std::size_t>(g)]);
        for (const std::int64_t end = std::min(steps, c + per_scale); c < end; ++c) step(c, s);
      }
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[m]);
      float sum = 0.0f;
      for (const float l : lanes) sum += l;
      // The zero points' term over the whole steps, eight groups at a time: Σa·(8 − zero)·scale.
      if (w.zeros != nullptr) sum += zero_term(w, n, sums.data() + m * w.groups, row_scales, kv);
      // K past the whole steps: (code − zero) · a per group, then its scale.
      for (std::int64_t j = kv; j < p.k;) {
        const std::int64_t g = j / w.group, end = std::min(p.k, (g + 1) * w.group);
        const auto zero = static_cast<float>(w.zero(n, g));
        float part = 0.0f;
        for (; j < end; ++j) {
          part += a_at(p, m, j) * (static_cast<float>(w.code(n, j)) - zero);
        }
        sum += part * w.scale(n, g);
      }
      store(p, m, n, sum);
    }
  }
}

}  // namespace

// The entry point carries no target attribute (see decode_bf16.cpp); the bodies it calls do.
template <int MB>
void int4_rows_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  int4_rows<MB>(p, n0, n1);
}

template void int4_rows_avx2<1>(const GemmParams&, std::int64_t, std::int64_t);
template void int4_rows_avx2<2>(const GemmParams&, std::int64_t, std::int64_t);
template void int4_rows_avx2<4>(const GemmParams&, std::int64_t, std::int64_t);

}  // namespace metrale::cpu::w4a16::detail
