// The tiled route with AVX2 and FMA (tiled_panels.h has the block loop): the AVX-512 FP32
// kernel's structure (tiled_avx512.cpp) at half the width. A panel holds k of column c at
// k * 32 + c in FP32 with the block scales multiplied in; 8 columns' codes at a time are
// transposed so that one vector holds the same pairs of every column; register tiles of 6 rows
// × 16 columns fit AVX2's 16 registers, two per panel.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/kernels/scales_avx2.h"
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
static_assert(kAvx2PanelK / 16 <= 8, "panel_scales_avx2 transposes at most eight groups");

// rows[i] dword j -> rows[j] dword i for 8 × 8 dwords. Written out, so that the rows stay in
// registers (GCC kept the looped form's arrays on the stack: a store and a load per shuffle).
[[METRALE_TARGET_AVX2, gnu::always_inline]] inline void transpose8(__m256i* r) {
  const __m256i a0 = _mm256_unpacklo_epi32(r[0], r[1]), a1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i a2 = _mm256_unpacklo_epi32(r[2], r[3]), a3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i a4 = _mm256_unpacklo_epi32(r[4], r[5]), a5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i a6 = _mm256_unpacklo_epi32(r[6], r[7]), a7 = _mm256_unpackhi_epi32(r[6], r[7]);
  // b*, 128-bit half h: column 4h + (0..3) of rows 0..3 (b0..b3) or 4..7 (b4..b7).
  const __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
  const __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
  const __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
  const __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
  r[0] = _mm256_permute2x128_si256(b0, b4, 0x20);
  r[1] = _mm256_permute2x128_si256(b1, b5, 0x20);
  r[2] = _mm256_permute2x128_si256(b2, b6, 0x20);
  r[3] = _mm256_permute2x128_si256(b3, b7, 0x20);
  r[4] = _mm256_permute2x128_si256(b0, b4, 0x31);
  r[5] = _mm256_permute2x128_si256(b1, b5, 0x31);
  r[6] = _mm256_permute2x128_si256(b2, b6, 0x31);
  r[7] = _mm256_permute2x128_si256(b3, b7, 0x31);
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
  struct Bits {
    alignas(32) std::uint32_t v[8];
  };
  // Built once: each pack of 8 columns asks for it (1.9% of the route's time at M = 16 when it
  // was built per call).
  static const Bits bits = [] {
    Bits b{};
    std::memcpy(b.v, tables().e2m1, sizeof b.v);
    for (std::uint32_t i = 0; i < 8; ++i) b.v[i] ^= i << 28;
    return b;
  }();
  return _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bits.v)));
}

// Pair p of columns c0..c0+7 from their code bytes (low byte of each lane): two FP32 rows.
[[METRALE_TARGET_AVX2, gnu::always_inline]] inline void put_pair(float* panel, std::int64_t p,
                                                                 int c0, __m256i bytes,
                                                                 __m256 scale, __m256 table) {
  _mm256_storeu_ps(panel + 2 * p * kPanelCols + c0, _mm256_mul_ps(e2m1x8(table, bytes), scale));
  _mm256_storeu_ps(panel + (2 * p + 1) * kPanelCols + c0,
                   _mm256_mul_ps(e2m1x8(table, _mm256_srli_epi32(bytes, 4)), scale));
}

// panel_scales (tiled_panels.h) with vectors: each column's scale codes decoded in one vector
// and 8 columns transposed, so that vector g holds group g of every column, as
// panel_scales_avx512 does (the scalar loop stores a float at a time, eight per column).
[[METRALE_TARGET_AVX2]] void panel_scales_avx2(const Weights& w, std::int64_t n0, std::int64_t nc,
                                               std::int64_t k0, std::int64_t kc, float* out) {
  const std::int64_t groups = w.k / w.group, g0 = k0 / w.group, count = kc / w.group;  // <= 8
  for (int c0 = 0; c0 < kPanelCols; c0 += 8) {
    const int live = static_cast<int>(std::clamp<std::int64_t>(nc - c0, 0, 8));
    if (w.transposed) {
      for (std::int64_t g = 0; g < count; ++g) {
        std::uint64_t raw = 0;  // the live columns' codes; the rest stay zero
        std::memcpy(&raw, w.scales + (g0 + g) * w.n + n0 + c0, static_cast<std::size_t>(live));
        const __m256i code = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(raw)));
        const __m256 live_lanes = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        _mm256_store_ps(out + g * kPanelCols + c0,
                        _mm256_and_ps(scales8(code, w.mxfp4), live_lanes));
      }
      continue;
    }
    __m256i r[8];
    const __m256 in_panel = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      std::uint64_t raw = 0;
      if (j < live) {
        const std::uint8_t* s = w.scales + (n0 + c0 + j) * groups + g0;
        if (count == 8) {
          std::memcpy(&raw, s, 8);  // a fixed size: one load, not a call
        } else {
          std::memcpy(&raw, s, static_cast<std::size_t>(count));
        }
        _mm_prefetch(reinterpret_cast<const char*>(s + count), _MM_HINT_T0);  // the next panel's
      }
      const __m256i code = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(raw)));
      // Columns past nc read code 0 (a finite scale) and are zeroed with the lanes past count.
      const __m256 v =
          j < live ? _mm256_and_ps(scales8(code, w.mxfp4), in_panel) : _mm256_setzero_ps();
      r[j] = _mm256_castps_si256(v);
    }
    transpose8(r);
    for (std::int64_t g = 0; g < count; ++g) {
      _mm256_store_ps(out + g * kPanelCols + c0, _mm256_castsi256_ps(r[g]));
    }
  }
}

// The row-major columns c0..c0+7 of a panel (pack_panel): 32 code bytes (32 pairs) of each at a
// time, transposed so that vector d holds pairs 4d..4d+3 of every column. Shift (pairs per scale
// group, log2) is a template argument and the full blocks' loops are unrolled, so that every
// scale's offset is a constant and the eight rows stay in registers.
template <int Shift>
[[METRALE_TARGET_AVX2]] void pack_rows(const Weights& w, std::int64_t n0, int c0, int live,
                                       std::int64_t k0, std::int64_t pairs, const float* scales,
                                       float* panel) {
  const __m256 table = xor_table();
  const std::int64_t row_bytes = w.k / 2;
  auto put = [&](std::int64_t p, __m256i bytes) __attribute__((always_inline, target("avx2,fma"))) {
    put_pair(panel, p, c0, bytes, _mm256_load_ps(scales + (p >> Shift) * kPanelCols + c0), table);
  };
  for (std::int64_t p0 = 0; p0 < pairs; p0 += 32) {
    const int words = static_cast<int>(std::min<std::int64_t>(8, (pairs - p0) / 4));
    __m256i r[8];
    const std::uint8_t* src = w.codes + (n0 + c0) * row_bytes + k0 / 2 + p0;
    if (words == 8 && live == 8) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        r[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j * row_bytes));
        // The next panel's bytes of this row (see tiled_avx512.cpp).
        _mm_prefetch(reinterpret_cast<const char*>(src + j * row_bytes + kAvx2PanelK / 2),
                     _MM_HINT_T0);
      }
      transpose8(r);
#pragma GCC unroll 8
      for (int d = 0; d < 8; ++d) {
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) put(p0 + 4 * d + q, _mm256_srli_epi32(r[d], 8 * q));
      }
      continue;
    }
    // A panel's last pairs, or fewer than 8 columns: masked loads, zero rows.
    alignas(32) std::int32_t lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = i < words ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    for (int j = 0; j < 8; ++j) {
      r[j] = j < live
                 ? _mm256_maskload_epi32(reinterpret_cast<const int*>(src + j * row_bytes), mask)
                 : _mm256_setzero_si256();
    }
    transpose8(r);
    for (int d = 0; d < words; ++d) {
      for (int q = 0; q < 4; ++q) put(p0 + 4 * d + q, _mm256_srli_epi32(r[d], 8 * q));
    }
  }
}

[[METRALE_TARGET_AVX2]] void pack_panel(const Weights& w, std::int64_t n0, std::int64_t nc,
                                        std::int64_t k0, std::int64_t kc, float* panel) {
  alignas(32) float scales[kPanelK / 16 * kPanelCols];
  panel_scales_avx2(w, n0, nc, k0, kc, scales);
  const std::int64_t pairs = kc / 2;
  const int shift = pair_group_shift(w);
  for (int c0 = 0; c0 < kPanelCols; c0 += 8) {
    const int live = static_cast<int>(std::clamp<std::int64_t>(nc - c0, 0, 8));
    if (!w.transposed) {
      if (shift == 3) {
        pack_rows<3>(w, n0, c0, live, k0, pairs, scales, panel);
      } else {
        pack_rows<4>(w, n0, c0, live, k0, pairs, scales, panel);
      }
      continue;
    }
    const __m256 table = xor_table();
    for (std::int64_t p = 0; p < pairs; ++p) {
      std::uint64_t raw = 0;  // the live columns' bytes; the rest stay zero
      std::memcpy(&raw, w.codes + (k0 / 2 + p) * w.n + n0 + c0, static_cast<std::size_t>(live));
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(raw)));
      put_pair(panel, p, c0, bytes, _mm256_load_ps(scales + (p >> shift) * kPanelCols + c0), table);
    }
  }
}

// BF16 to FP32 eight at a time, for staged_a_f32_by (tiled_panels.h).
[[METRALE_TARGET_AVX2]] void widen8(const std::uint16_t* src, float* dst, std::int64_t count) {
  for (std::int64_t k = 0; k < count; k += 8) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
    _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
}

const float* stage_a(const GemmParams& p, std::int64_t k0, std::int64_t kc,
                     std::vector<float>& staged, std::int64_t& lda) {
  return staged_a_f32_by<8>(p, k0, kc, staged, lda, widen8);
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
