// The tiled route with AVX2 and FMA (tiled_panels.h has the block loop): the AVX-512 FP32
// kernel's structure (tiled_avx512.cpp) at half the width. A panel holds k of column c at
// k * 32 + c in FP32 with the block scales multiplied in; 8 columns' codes at a time are
// transposed so that one vector holds the same pairs of every column; register tiles of 6 rows
// × 16 columns fit AVX2's 16 registers, two per panel.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/kernels/tiled_panels.h"
#include "cpu/kernels/w4a16_shared.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace metrale::cpu::w4a16::detail {
namespace {

#define METRALE_TARGET_AVX2 gnu::target("avx2,fma")

// K per panel: 128 × 32 FP32 weights are 16 KiB, so the panel, the staged rows of A and the
// accumulators stay in L1 together (Zen 3's is 32 KiB). Side by side on one core, 256 took
// 1/0.87 of this time at M = 16 and 1/0.84 at M = 64 (docs/PERF.md).
constexpr std::int64_t kAvx2PanelK = 128;

// rows[i] dword j -> rows[j] dword i for 8 × 8 dwords.
[[METRALE_TARGET_AVX2, gnu::always_inline]] inline void transpose8(__m256i* r) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  // b[4g + c], 128-bit half h: column 4h + c of rows 4g..4g+3.
  for (int g = 0; g < 8; g += 4) {
    b[g] = _mm256_unpacklo_epi64(a[g], a[g + 2]);
    b[g + 1] = _mm256_unpackhi_epi64(a[g], a[g + 2]);
    b[g + 2] = _mm256_unpacklo_epi64(a[g + 1], a[g + 3]);
    b[g + 3] = _mm256_unpackhi_epi64(a[g + 1], a[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
    r[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
  }
}

// E2M1 codes in the low nibble of each lane (bits above ignored) to FP32 in two operations: the
// magnitude by permute (it reads the low 3 bits) from a table whose entry i has i << 28 XORed
// in (xor_table), and the lane shifted left by 28 XORed over it, which cancels those bits and
// moves bit 3 into the sign.
[[METRALE_TARGET_AVX2, gnu::always_inline]] inline __m256 e2m1x8(__m256 table, __m256i nib) {
  const __m256 v = _mm256_permutevar8x32_ps(table, nib);
  return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(nib, 28)));
}

[[METRALE_TARGET_AVX2]] __m256 xor_table() {
  alignas(32) std::uint32_t bits[8];
  std::memcpy(bits, tables().e2m1, sizeof bits);
  for (std::uint32_t i = 0; i < 8; ++i) bits[i] ^= i << 28;
  return _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bits)));
}

// Pair p of columns c0..c0+7 from their code bytes (low byte of each lane): two FP32 rows.
[[METRALE_TARGET_AVX2, gnu::always_inline]] inline void put_pair(float* panel, std::int64_t p,
                                                                 int c0, __m256i bytes,
                                                                 __m256 scale, __m256 table) {
  _mm256_storeu_ps(panel + 2 * p * kPanelCols + c0, _mm256_mul_ps(e2m1x8(table, bytes), scale));
  _mm256_storeu_ps(panel + (2 * p + 1) * kPanelCols + c0,
                   _mm256_mul_ps(e2m1x8(table, _mm256_srli_epi32(bytes, 4)), scale));
}

[[METRALE_TARGET_AVX2]] void pack_panel(const Weights& w, std::int64_t n0, std::int64_t nc,
                                        std::int64_t k0, std::int64_t kc, float* panel) {
  alignas(32) float scales[kPanelK / 16 * kPanelCols];
  panel_scales(w, n0, nc, k0, kc, scales);
  const __m256 table = xor_table();
  const std::int64_t pairs = kc / 2, row_bytes = w.k / 2;
  const int shift = pair_group_shift(w);
  for (int c0 = 0; c0 < kPanelCols; c0 += 8) {
    const int live = static_cast<int>(std::clamp<std::int64_t>(nc - c0, 0, 8));
    auto scale_of = [&](std::int64_t pair) __attribute__((always_inline, target("avx2,fma"))) {
      return _mm256_load_ps(scales + (pair >> shift) * kPanelCols + c0);
    };
    if (w.transposed) {
      for (std::int64_t p = 0; p < pairs; ++p) {
        std::uint64_t raw = 0;  // the live columns' bytes; the rest stay zero
        std::memcpy(&raw, w.codes + (k0 / 2 + p) * w.n + n0 + c0, static_cast<std::size_t>(live));
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(raw)));
        put_pair(panel, p, c0, bytes, scale_of(p), table);
      }
      continue;
    }
    // Row-major: 32 code bytes (32 pairs) of 8 columns at a time, transposed so that vector d
    // holds pairs 4d..4d+3 of every column.
    for (std::int64_t p0 = 0; p0 < pairs; p0 += 32) {
      const int words = static_cast<int>(std::min<std::int64_t>(8, (pairs - p0) / 4));
      alignas(32) std::int32_t lanes[8];
      for (int i = 0; i < 8; ++i) lanes[i] = i < words ? -1 : 0;
      const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
      __m256i r[8];
      for (int j = 0; j < 8; ++j) {
        if (j >= live) {
          r[j] = _mm256_setzero_si256();
          continue;
        }
        const std::uint8_t* src = w.codes + (n0 + c0 + j) * row_bytes + k0 / 2 + p0;
        r[j] = _mm256_maskload_epi32(reinterpret_cast<const int*>(src), mask);
        // The next panel's bytes of this row (see tiled_avx512.cpp).
        _mm_prefetch(reinterpret_cast<const char*>(src + kAvx2PanelK / 2), _MM_HINT_T0);
      }
      transpose8(r);
      for (int d = 0; d < words; ++d) {
        for (int q = 0; q < 4; ++q) {
          const std::int64_t p = p0 + 4 * d + q;
          put_pair(panel, p, c0, _mm256_srli_epi32(r[d], 8 * q), scale_of(p), table);
        }
      }
    }
  }
}

// A's rows [0, M) x [k0, k0 + kc) in FP32, row stride kc (staged_a_f32 of tiled_panels.h, eight
// elements per conversion: every block stages its rows again for each K panel, which in scalar
// code cost a third as many instructions as the block's multiply-adds at M = 256).
[[METRALE_TARGET_AVX2]] const float* stage_a(const GemmParams& p, std::int64_t k0, std::int64_t kc,
                                             std::vector<float>& staged, std::int64_t& lda) {
  staged.resize(static_cast<std::size_t>(p.m * kc));
  const auto* a = at<const std::uint16_t>(p.a);
  for (std::int64_t m = 0; m < p.m; ++m) {
    const std::uint16_t* src = a + m * p.k + k0;
    float* dst = staged.data() + m * kc;
    std::int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
      const __m256i wide =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
      _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
    for (; k < kc; ++k) dst[k] = num::bf16_to_f32(src[k]);
  }
  lda = kc;
  return staged.data();
}

// acc[MR rows, 16 columns from col] += A[MR rows, kc] (staged FP32) · FP32 panel. Every loop
// over rows is unrolled so that the accumulators live in registers (a rolled loop kept them in
// memory, a store per multiply-add).
template <int MR>
[[METRALE_TARGET_AVX2]] void tile_f32(const float* a, std::int64_t lda, const float* panel,
                                      std::int64_t kc, float* acc, std::int64_t ldc) {
  for (int col = 0; col < kPanelCols; col += 16) {
    __m256 c0[MR], c1[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      c0[r] = _mm256_loadu_ps(acc + r * ldc + col);
      c1[r] = _mm256_loadu_ps(acc + r * ldc + col + 8);
    }
    for (std::int64_t k = 0; k < kc; ++k) {
      const __m256 w0 = _mm256_loadu_ps(panel + k * kPanelCols + col);
      const __m256 w1 = _mm256_loadu_ps(panel + k * kPanelCols + col + 8);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
        c0[r] = _mm256_fmadd_ps(x, w0, c0[r]);
        c1[r] = _mm256_fmadd_ps(x, w1, c1[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(acc + r * ldc + col, c0[r]);
      _mm256_storeu_ps(acc + r * ldc + col + 8, c1[r]);
    }
  }
}

// Register tiles of up to 6 rows: 12 accumulators, two panel vectors and a broadcast fill
// AVX2's 16 registers, and 12 independent multiply-add chains cover the FMA latency.
constexpr void (*kTiles[])(const float*, std::int64_t, const float*, std::int64_t, float*,
                           std::int64_t) = {tile_f32<1>, tile_f32<2>, tile_f32<3>,
                                            tile_f32<4>, tile_f32<5>, tile_f32<6>};

}  // namespace

void tiled_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  tiled_block(p, n0, n1, TiledKernel<float, float>{6, kAvx2PanelK, stage_a, pack_panel, kTiles});
}

}  // namespace metrale::cpu::w4a16::detail
