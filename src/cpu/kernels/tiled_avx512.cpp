// The tiled route on AVX-512 processors (tiled_panels.h has the block loop): per 32 output
// columns, K in panels of 256 dequantized once per block with the block scales multiplied in
// (exact: see tiled_panels.h), then register tiles over every row tile of the block. With
// AVX-512 BF16 a panel holds BF16 pairs for vdpbf16ps; without, FP32 for FMAs. See Note [CPU
// tiled panels] in docs/NOTES.md for the layouts and the figures behind them.
//
// A BF16 panel holds pair p (k = 2p and 2p + 1) of column c as one dword at p * 32 + c, the low
// BF16 the even k, as vdpbf16ps pairs them. A row's pair is broadcast from A as it lies (two
// consecutive BF16), so lane c of one vdpbf16ps adds A[m, 2p] W[c, 2p] + A[m, 2p + 1] W[c, 2p + 1]:
// an 8 × 32 tile reads each panel vector once per 8 rows and each A pair once per 32 columns. An
// FP32 panel holds k of column c at k * 32 + c, and A is staged in FP32 for the broadcasts.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu/kernels/pairs_bf16.h"
#include "cpu/kernels/scales_avx512.h"
#include "cpu/kernels/tiled_panels.h"
#include "cpu/kernels/transpose_avx512.h"
#include "cpu/kernels/w4a16_shared.h"
#include "kernels/panel_layout.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {
namespace {

#define METRALE_TARGET_AVX512 gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma")

// 16 columns' pair of weights, from their code bytes in the low byte of each lane (the bits
// above are ignored), times their block scales: the even k (lo) and the odd k (hi) in FP32.
struct Pair16 {
  __m512 lo, hi;
};
[[METRALE_TARGET_AVX512, gnu::always_inline]] inline Pair16 decode_pair(__m512i bytes, __m512 scale,
                                                                        __m512 lut) {
  return {_mm512_mul_ps(_mm512_permutexvar_ps(bytes, lut), scale),
          _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lut), scale)};
}

// Writes pair p of columns c0..c0+15 into a panel: BF16 pairs (truncation is exact here) or two
// FP32 rows.
template <bool Bf16, class Panel>
[[METRALE_TARGET_AVX512, gnu::always_inline]] inline void put_pair(Panel* panel, std::int64_t p,
                                                                   int c0, Pair16 v) {
  if constexpr (Bf16) {
    // Word 2j: lo's word 2j + 1 (its BF16), word 2j + 1: hi's word 2j + 1, in one permute.
    const __m512i pick =
        _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17, 47, 15, 45,
                         13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    const __m512i words =
        _mm512_permutex2var_epi16(_mm512_castps_si512(v.lo), pick, _mm512_castps_si512(v.hi));
    _mm512_storeu_si512(panel + p * kPanelCols + c0, words);
  } else {
    _mm512_storeu_ps(panel + 2 * p * kPanelCols + c0, v.lo);
    _mm512_storeu_ps(panel + (2 * p + 1) * kPanelCols + c0, v.hi);
  }
}

// panel_scales (tiled_panels.h) with vectors: each column's scale codes decoded in one vector
// and 16 columns transposed, so that vector g holds group g of every column. The scalar loop
// was a sixth of the route's time at M = 16.
[[METRALE_TARGET_AVX512]] void panel_scales_avx512(const Weights& w, std::int64_t n0,
                                                   std::int64_t nc, std::int64_t k0,
                                                   std::int64_t kc, float* out) {
  const std::int64_t groups = w.k / w.group, g0 = k0 / w.group, count = kc / w.group;
  const auto bytes = static_cast<__mmask16>((1u << count) - 1);  // count <= 16
  for (int c0 = 0; c0 < kPanelCols; c0 += 16) {
    const int live = static_cast<int>(std::clamp<std::int64_t>(nc - c0, 0, 16));
    if (w.transposed) {
      const auto cols = static_cast<__mmask16>((1u << live) - 1);
      for (std::int64_t g = 0; g < count; ++g) {
        const __m128i raw = _mm_maskz_loadu_epi8(cols, w.scales + (g0 + g) * w.n + n0 + c0);
        const __m512 v = scales16(_mm512_cvtepu8_epi32(raw), w.mxfp4);
        _mm512_store_ps(out + g * kPanelCols + c0, _mm512_maskz_mov_ps(cols, v));
      }
      continue;
    }
    __m512i r[16];
    for (int j = 0; j < 16; ++j) {
      if (j >= live) {
        r[j] = _mm512_setzero_si512();
        continue;
      }
      const std::uint8_t* s = w.scales + (n0 + c0 + j) * groups + g0;
      const __m128i raw = _mm_maskz_loadu_epi8(bytes, s);
      r[j] = _mm512_castps_si512(
          _mm512_maskz_mov_ps(bytes, scales16(_mm512_cvtepu8_epi32(raw), w.mxfp4)));
      _mm_prefetch(reinterpret_cast<const char*>(s + count), _MM_HINT_T0);  // the next panel's
    }
    transpose16(r);
    for (std::int64_t g = 0; g < count; ++g) {
      _mm512_store_ps(out + g * kPanelCols + c0, _mm512_castsi512_ps(r[g]));
    }
  }
}

// Dequantizes columns [n0, n0 + nc) × [k0, k0 + kc) into a panel (layouts above); columns past
// nc are zero.
template <bool Bf16, class Panel>
[[METRALE_TARGET_AVX512]] void pack_panel(const Weights& w, std::int64_t n0, std::int64_t nc,
                                          std::int64_t k0, std::int64_t kc, Panel* panel) {
  alignas(64) float scales[kPanelK / 16 * kPanelCols];
  panel_scales_avx512(w, n0, nc, k0, kc, scales);
  const __m512 lut = _mm512_loadu_ps(tables().e2m1);
  const std::int64_t pairs = kc / 2, row_bytes = w.k / 2;
  const int shift = pair_group_shift(w);
  for (int c0 = 0; c0 < kPanelCols; c0 += 16) {
    const int live = static_cast<int>(std::clamp<std::int64_t>(nc - c0, 0, 16));
    auto scale_of = [&](std::int64_t pair)
        __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) {
      return _mm512_load_ps(scales + (pair >> shift) * kPanelCols + c0);
    };
    if (w.transposed) {
      // Pair p of every column is one run of bytes: no transpose.
      const __mmask16 cols = static_cast<__mmask16>((1u << live) - 1);
      for (std::int64_t p = 0; p < pairs; ++p) {
        const __m128i raw = _mm_maskz_loadu_epi8(cols, w.codes + (k0 / 2 + p) * w.n + n0 + c0);
        put_pair<Bf16>(panel, p, c0, decode_pair(_mm512_cvtepu8_epi32(raw), scale_of(p), lut));
      }
      continue;
    }
    // Row-major: 64 code bytes (64 pairs) of 16 columns at a time, transposed so that vector d
    // holds pairs 4d..4d+3 of every column, one byte each.
    for (std::int64_t p0 = 0; p0 < pairs; p0 += 64) {
      const int words = static_cast<int>(std::min<std::int64_t>(16, (pairs - p0) / 4));
      const __mmask16 mask = static_cast<__mmask16>((1u << words) - 1);
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        if (j >= live) {
          r[j] = _mm512_setzero_si512();
          continue;
        }
        const std::uint8_t* src = w.codes + (n0 + c0 + j) * row_bytes + k0 / 2 + p0;
        r[j] = words == 16 ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi32(mask, src);
        // The next panel's bytes of this row: 16 rows' misses at once would stall the pack
        // (it was memory-latency-bound), and a prefetch never faults.
        _mm_prefetch(reinterpret_cast<const char*>(src + kPanelK / 2), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(src + 2 * kPanelK), _MM_HINT_T1);
      }
      transpose16(r);
      for (int d = 0; d < words; ++d) {
        // Pairs 4d..4d+3 lie in one block (8 or 16 pairs), so they share a scale vector.
        const std::int64_t p = p0 + 4 * d;
        const __m512 scale = scale_of(p);
        put_pair<Bf16>(panel, p, c0, decode_pair(r[d], scale, lut));
        put_pair<Bf16>(panel, p + 1, c0, decode_pair(_mm512_srli_epi32(r[d], 8), scale, lut));
        put_pair<Bf16>(panel, p + 2, c0, decode_pair(_mm512_srli_epi32(r[d], 16), scale, lut));
        put_pair<Bf16>(panel, p + 3, c0, decode_pair(_mm512_srli_epi32(r[d], 24), scale, lut));
      }
    }
  }
}

// The BF16 panel from weights in the panel layout (kernels/panel_layout.h): one 64-byte line is
// 16 columns × 8 K, and its words shifted by 0, 4, 8 and 12 look up the panel's four pair vectors
// with no transpose. Each pair goes through FP32 for its block scale, and its upper 16 bits are
// the BF16 weight exactly (E2M1 × scale fits BF16; tiled_panels.h says which scales do). Columns
// past nc are the layout's padding: code 0, so zero.
[[METRALE_TARGET_AVX512BF16]] void pack_from_panels(const Weights& w, std::int64_t n0, std::int64_t,
                                                    std::int64_t k0, std::int64_t kc,
                                                    std::uint32_t* panel) {
  const __m512i lut = _mm512_load_si512(tables().e2m1_bf16);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const std::int64_t lines_per_block = w.group / panel_layout::kLineK;
  for (int half = 0; half < 2; ++half) {
    const std::int64_t g = n0 / panel_layout::kGroupCols + half;
    const std::uint8_t* src =
        w.codes + panel_layout::line_offset(w.k, g, k0 / panel_layout::kLineK);
    const std::uint8_t* sc =
        w.scales + panel_layout::scale_offset(w.k, static_cast<int>(w.group), g, k0 / w.group);
    __m512 scale = _mm512_setzero_ps();
    for (std::int64_t t = 0; t < kc / panel_layout::kLineK; ++t) {
      if (t % lines_per_block == 0) {
        scale = scales16_at(sc + t / lines_per_block * panel_layout::kGroupCols, w.mxfp4);
      }
      const __m512i line = _mm512_loadu_si512(src + t * panel_layout::kLineBytes);
      std::uint32_t* out = panel + 4 * t * kPanelCols + half * 16;
      for (int s = 0; s < 4; ++s) {
        const __m512i pairs = _mm512_permutexvar_epi16(
            s == 0 ? line : _mm512_srli_epi16(line, panel_layout::nibble_shift(s)), lut);
        const __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)), scale);
        const __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(pairs, high)), scale);
        _mm512_storeu_si512(out + s * kPanelCols,
                            _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(hi), high),
                                            _mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
      }
    }
  }
}

// acc[MR rows, 32] (FP32, row stride ldc) += A[MR rows, kc] · BF16 panel.
template <int MR>
[[METRALE_TARGET_AVX512BF16]] void tile_bf16(const std::uint16_t* a, std::int64_t lda,
                                             const std::uint32_t* panel, std::int64_t kc,
                                             float* acc, std::int64_t ldc) {
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) {
    c[r][0] = _mm512_loadu_ps(acc + r * ldc);
    c[r][1] = _mm512_loadu_ps(acc + r * ldc + 16);
  }
  add_panel_products<MR>(a, lda, panel, kc, c);
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc + r * ldc, c[r][0]);
    _mm512_storeu_ps(acc + r * ldc + 16, c[r][1]);
  }
}

// BF16 to FP32 sixteen at a time, for staged_a_f32_by (tiled_panels.h).
[[METRALE_TARGET_AVX512]] void widen16(const std::uint16_t* src, float* dst, std::int64_t count) {
  for (std::int64_t k = 0; k < count; k += 16) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
    _mm512_storeu_ps(dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
}

const float* stage_a_f32(const GemmParams& p, std::int64_t k0, std::int64_t kc,
                         std::vector<float>& staged, std::int64_t& lda) {
  return staged_a_f32_by<16>(p, k0, kc, staged, lda, widen16);
}

// acc[MR rows, 32] += A[MR rows, kc] (staged FP32) · FP32 panel.
template <int MR>
[[METRALE_TARGET_AVX512]] void tile_f32(const float* a, std::int64_t lda, const float* panel,
                                        std::int64_t kc, float* acc, std::int64_t ldc) {
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) {
    c[r][0] = _mm512_loadu_ps(acc + r * ldc);
    c[r][1] = _mm512_loadu_ps(acc + r * ldc + 16);
  }
  for (std::int64_t k = 0; k < kc; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanelCols);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanelCols + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      c[r][0] = _mm512_fmadd_ps(x, w0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(x, w1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc + r * ldc, c[r][0]);
    _mm512_storeu_ps(acc + r * ldc + 16, c[r][1]);
  }
}

// Row tiles of 8: 16 accumulators and two panel vectors leave registers for the broadcasts.
constexpr void (*kBf16Tiles[])(const std::uint16_t*, std::int64_t, const std::uint32_t*,
                               std::int64_t, float*, std::int64_t) = {
    tile_bf16<1>, tile_bf16<2>, tile_bf16<3>, tile_bf16<4>,
    tile_bf16<5>, tile_bf16<6>, tile_bf16<7>, tile_bf16<8>};
constexpr void (*kF32Tiles[])(const float*, std::int64_t, const float*, std::int64_t, float*,
                              std::int64_t) = {tile_f32<1>, tile_f32<2>, tile_f32<3>, tile_f32<4>,
                                               tile_f32<5>, tile_f32<6>, tile_f32<7>, tile_f32<8>};

}  // namespace

void tiled_avx512bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  tiled_block(p, n0, n1,
              TiledKernel<std::uint32_t, std::uint16_t>{8, kPanelK, unstaged_a, pack_panel<true>,
                                                        kBf16Tiles});
}

void tiled_avx512bf16_panels(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  tiled_block(p, n0, n1,
              TiledKernel<std::uint32_t, std::uint16_t>{8, kPanelK, unstaged_a, pack_from_panels,
                                                        kBf16Tiles});
}

void tiled_avx512(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  tiled_block(p, n0, n1,
              TiledKernel<float, float>{8, kPanelK, stage_a_f32, pack_panel<false>, kF32Tiles});
}

}  // namespace metrale::cpu::w4a16::detail
