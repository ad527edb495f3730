// The body of the block-scaled FP8 dense GEMM's vector kernels (dense_e4m3.h), compiled twice:
// by dense_e4m3_avx512.cpp for AVX-512 BF16 and by dense_e4m3_vbmi.cpp for AVX-512 BF16 with
// VBMI, which widens codes by byte lookups instead of arithmetic. A function's instruction set
// is its target attribute, so the two copies are two instantiations of this text, not of a
// template. Include only from those files, after defining METRALE_E4M3_VBMI (0 or 1). Every
// E4M3 code is exact in BF16 and vdpbf16ps multiplies BF16 pairs exactly and adds in FP32, so
// the kernels sum the reference's products, only in another order. See Note [E4M3 as BF16].
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu/kernels/dense_store.h"
#include "cpu/kernels/pairs_bf16.h"
#include "cpu/kernels/transpose_avx512.h"
#include "cpu/kernels/w4a16_shared.h"
#include "kernels/dense_params.h"
#include "kernels/fp8_panel_layout.h"
#include "metrale/dense_gemm.h"
#include "metrale/numerics.h"

#if METRALE_E4M3_VBMI
#define METRALE_E4M3_TARGET gnu::target(METRALE_AVX512BF16_FEATURES ",avx512vbmi")
#define METRALE_E4M3_VARIANT vbmi
#else
#define METRALE_E4M3_TARGET METRALE_TARGET_AVX512BF16
#define METRALE_E4M3_VARIANT avx512bf16
#endif

// As in the w4a16 kernels: vector arguments of always-inlined helpers (-Wpsabi), and GCC 12's
// _mm512_reduce_add_ps, whose header leaves a lane "maybe uninitialized".
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::blas::METRALE_E4M3_VARIANT {

constexpr std::int64_t kChunk = 64;  // K per step: two vectors of 32 BF16
constexpr int kRowTile = 8;          // up to this many rows, B is widened in registers
// Above it, each 128-K block of 32 columns is widened into a panel (the tiled kernels' layout)
// that row tiles of this many rows read.
constexpr int kPanelRows = 8;
constexpr std::int64_t kPanelCols = w4a16::detail::kPanelCols;
// How far ahead in a row the pack fetches lines into L2 (its L1 fetch is the next block's).
constexpr std::int64_t kPackAheadL2 = 1024;
// How far ahead in a row of B lines are fetched, into L1 and into L2: the weights stream from
// DRAM, and as in the w4a16 decode kernel the far L2 hint is what keeps a core's stream from
// being latency-bound (Note [L2 read-ahead distance]).
constexpr std::int64_t kPrefetchL1 = 2048, kPrefetchL2 = 16384;

#if METRALE_E4M3_VBMI
// BF16 bits of the 128 magnitudes (codes & 0x7F), split into their high and low bytes: the
// tables of the two vpermi2b lookups (each reads an index's low 7 bits over two registers).
struct ByteTables {
  alignas(64) std::uint8_t hi[128];
  alignas(64) std::uint8_t lo[128];
};

inline const ByteTables& byte_tables() {
  static const ByteTables t = [] {
    ByteTables x{};
    for (int i = 0; i < 128; ++i) {
      const std::uint16_t bits = num::f32_to_bf16(num::e4m3_to_f32(static_cast<std::uint8_t>(i)));
      x.hi[i] = static_cast<std::uint8_t>(bits >> 8);
      x.lo[i] = static_cast<std::uint8_t>(bits & 0xFF);
    }
    return x;
  }();
  return t;
}

// Output byte j of the interleaves below: byte j / 2 of the first source (the BF16's low byte)
// for even j, of the second (its high byte, index 64 + j / 2) for odd j; the second index table
// starts at code 32.
struct InterleaveIndex {
  alignas(64) std::uint8_t lo[64];
  alignas(64) std::uint8_t hi[64];
};

inline const InterleaveIndex& interleave_index() {
  static const InterleaveIndex t = [] {
    InterleaveIndex x{};
    for (int j = 0; j < 64; ++j) {
      x.lo[j] = static_cast<std::uint8_t>((j % 2 ? 64 : 0) + j / 2);
      x.hi[j] = static_cast<std::uint8_t>((j % 2 ? 64 : 0) + 32 + j / 2);
    }
    return x;
  }();
  return t;
}

// 64 codes as BF16 in two vectors: both bytes of each magnitude looked up, the sign ORed into the
// high byte, the bytes interleaved into words. kKOrder: in K order (lo: codes 0-31), by vpermt2b,
// as the panels need; otherwise by vpunpck{l,h}bw, which work within 128-bit lanes (lo: codes
// 16j .. 16j + 7 of each lane j, hi: 16j + 8 .. 16j + 15), two index loads fewer, for the row
// tiles, where A is widened in the same order and the pairs still meet.
template <bool kKOrder>
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline void widen_codes(__m512i codes, __m512i& lo,
                                                                    __m512i& hi) {
  const ByteTables& t = byte_tables();
  const __m512i top =
      _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), codes, _mm512_load_si512(t.hi + 64));
  const __m512i bottom =
      _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), codes, _mm512_load_si512(t.lo + 64));
  // top | (codes & 0x80): the sign into bit 15.
  const __m512i signed_top =
      _mm512_ternarylogic_epi32(top, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  if constexpr (kKOrder) {
    const InterleaveIndex& x = interleave_index();
    lo = _mm512_permutex2var_epi8(bottom, _mm512_load_si512(x.lo), signed_top);
    hi = _mm512_permutex2var_epi8(bottom, _mm512_load_si512(x.hi), signed_top);
  } else {
    lo = _mm512_unpacklo_epi8(bottom, signed_top);
    hi = _mm512_unpackhi_epi8(bottom, signed_top);
  }
}
#else
// BF16 bits of E4M3 codes 0-7 (±0 and the subnormals, m·2^-9), which the exponent rebias below
// does not cover; vpermw reads the low five bits of the index, all zero above 7 here.
alignas(64) constexpr std::uint16_t kSubnormalBf16[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                                          0x3C00, 0x3C20, 0x3C40, 0x3C60};

// 32 E4M3 codes (zero-extended to words) as BF16: the magnitude's exponent rebiased from 7 to
// 127 and its 3 mantissa bits moved to the top of BF16's 7, codes 0-7 from the table, the sign
// moved to bit 15, and the NaN codes (0x7F, 0xFF) as a quiet NaN.
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline __m512i widen(__m512i words) {
  const __m512i mag = _mm512_and_si512(words, _mm512_set1_epi16(0x7F));
  __m512i bf = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  const __mmask32 small = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  bf = _mm512_mask_permutexvar_epi16(bf, small, mag, _mm512_load_si512(kSubnormalBf16));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F));
  bf = _mm512_mask_mov_epi16(bf, nan, _mm512_set1_epi16(0x7FC0));
  return _mm512_or_si512(bf,
                         _mm512_slli_epi16(_mm512_and_si512(words, _mm512_set1_epi16(0x80)), 8));
}

// 64 codes as BF16 in two vectors, in K order (lo: codes 0-31) either way.
template <bool kKOrder>
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline void widen_codes(__m512i codes, __m512i& lo,
                                                                    __m512i& hi) {
  lo = widen(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(codes)));
  hi = widen(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(codes, 1)));
}
#endif

// The codes [at, at + len) (len ≤ 64; zero beyond) as BF16 in two vectors (widen_codes).
template <bool kKOrder>
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline void widen64(const std::uint8_t* at,
                                                                std::int64_t len, __m512i& lo,
                                                                __m512i& hi) {
  const __mmask64 keep = len >= kChunk ? ~__mmask64{0} : (__mmask64{1} << len) - 1;
  widen_codes<kKOrder>(_mm512_maskz_loadu_epi8(keep, at), lo, hi);
}

// Chains of independent sums a row of the row-tile path keeps.
template <int R>
inline constexpr int kChainsOf = R <= 2 ? 4 : 2;

// One chunk of 64 K at k of B's row brow (len ≤ 64 codes left; zero beyond): widened once, its
// two halves multiplied with R rows of widened A into the sums H0 and H1 of each row.
template <int R, int H0, int H1>
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline void chunk_step(
    const std::uint8_t* brow, const std::uint16_t* aw, std::int64_t kpad, std::int64_t r0,
    std::int64_t k, std::int64_t len, __m512 (&acc)[R][kChainsOf<R>]) {
  // Addresses as integers: near the end of B they lie past it, where a prefetch is harmless
  // but pointer arithmetic is not defined.
  const auto at = reinterpret_cast<std::uintptr_t>(brow + k);
  _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchL1), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchL2), _MM_HINT_T1);
  __m512i w0, w1;
  widen64<false>(brow + k, len, w0, w1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const std::uint16_t* x = aw + (r0 + r) * kpad + k;
    acc[r][H0] = _mm512_dpbf16_ps(acc[r][H0], reinterpret_cast<__m512bh>(w0),
                                  reinterpret_cast<__m512bh>(_mm512_loadu_si512(x)));
    acc[r][H1] = _mm512_dpbf16_ps(acc[r][H1], reinterpret_cast<__m512bh>(w1),
                                  reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + 32)));
  }
}

// Rows r0 .. r0 + R of C[:, n0:n1]: for each column and 128-K block, B's codes widened once and
// multiplied with the R rows of widened A (aw, kpad apart); each row's block sum, still in 16
// lanes, times its two scales into the row's total, which is reduced once per column.
template <int R>
[[METRALE_E4M3_TARGET]] void rows_of(const DenseParams& p, const std::uint16_t* aw,
                                     std::int64_t kpad, std::int64_t r0, std::int64_t n0,
                                     std::int64_t n1) {
  const auto* b = reinterpret_cast<const std::uint8_t*>(p.b);
  const auto* sa = reinterpret_cast<const float*>(p.a_scales);
  const auto* sb = reinterpret_cast<const float*>(p.b_scales);
  const auto* bias = reinterpret_cast<const std::uint16_t*>(p.bias);
  const std::int64_t kblocks = dense_scale_blocks(p.k);
  const std::int64_t lda = a_scales_ld(p), ldb = dense_b_scales_ld(p.k);
  constexpr int kChains = kChainsOf<R>;
  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* brow = b + n * p.k;
    const float* sbrow = sb + (n / kDenseScaleBlock) * ldb;
    __m512 total[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (std::int64_t kb = 0; kb < kblocks; ++kb) {
      const std::int64_t k0 = kb * kDenseScaleBlock;
      const std::int64_t len = std::min(kDenseScaleBlock, p.k - k0);
      // Independent sums per row (kChains of them), so that few rows do not wait on one chain
      // of dependent vdpbf16ps; a full block's two chunks feed different ones.
      __m512 acc[R][kChains];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int h = 0; h < kChains; ++h) acc[r][h] = _mm512_setzero_ps();
      }
      if (len == kDenseScaleBlock) {
        chunk_step<R, 0, 1>(brow, aw, kpad, r0, k0, kChunk, acc);
        chunk_step<R, kChains - 2, kChains - 1>(brow, aw, kpad, r0, k0 + kChunk, kChunk, acc);
      } else {
        for (std::int64_t c = 0; c * kChunk < len; ++c) {
          chunk_step<R, 0, 1>(brow, aw, kpad, r0, k0 + c * kChunk, len - c * kChunk, acc);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512 sum = _mm512_add_ps(acc[r][0], acc[r][1]);
        if constexpr (kChains == 4) {
          sum = _mm512_add_ps(sum, _mm512_add_ps(acc[r][2], acc[r][3]));
        }
        const float scale = sa[kb * lda + r0 + r] * sbrow[kb];
        total[r] = _mm512_fmadd_ps(sum, _mm512_set1_ps(scale), total[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float v = _mm512_reduce_add_ps(total[r]);
      if (bias != nullptr) v += num::bf16_to_f32(bias[n]);
      store_c(p, static_cast<std::size_t>((r0 + r) * p.n + n), v);
    }
  }
}

template <int R>
[[METRALE_E4M3_TARGET]] void rows_up_to(int rows, const DenseParams& p, const std::uint16_t* aw,
                                        std::int64_t kpad, std::int64_t r0, std::int64_t n0,
                                        std::int64_t n1) {
  if constexpr (R > 1) {
    if (rows < R) return rows_up_to<R - 1>(rows, p, aw, kpad, r0, n0, n1);
  }
  rows_of<R>(p, aw, kpad, r0, n0, n1);
}

// B's columns [n, n + live) (live ≤ 32; zero past it) × K [k0, k0 + len) widened into a panel of
// the tiled kernels' layout (pairs_bf16.h: pair p of column c as one dword at p * 32 + c): per 16
// columns, their chunks of 64 codes turned by a 16 × 16 dword transpose into vectors of 4 codes of
// every column, each widened and split into its two pairs.
[[METRALE_E4M3_TARGET]] void pack_block(const DenseParams& p, std::int64_t n, std::int64_t live,
                                        std::int64_t k0, std::int64_t len, std::uint32_t* panel) {
  const auto* b = reinterpret_cast<const std::uint8_t*>(p.b);
  // Dwords of the widened halves' concatenation: the even ones (pairs 2d) and the odd ones.
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (std::int64_t h = 0; h < kPanelCols / 16; ++h) {
    for (std::int64_t c = 0; c * kChunk < len; ++c) {
      const std::int64_t left = len - c * kChunk;
      const __mmask64 keep = left >= kChunk ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        r[j] = _mm512_setzero_si512();
        if (16 * h + j >= live) continue;
        const std::uint8_t* at = b + (n + 16 * h + j) * p.k + k0 + c * kChunk;
        // The next block's line of this row into L1 and a later one's into L2: the rows are
        // 32 streams read 64 bytes at a time, which the hardware prefetchers did not follow (the
        // pack waited on its loads). Addresses as integers (chunk_step).
        const auto ahead = reinterpret_cast<std::uintptr_t>(at);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + kDenseScaleBlock), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + kPackAheadL2), _MM_HINT_T1);
        r[j] = _mm512_maskz_loadu_epi8(keep, at);
      }
      w4a16::detail::transpose16(r);  // r[d]: codes 4d .. 4d + 3 of each column
      std::uint32_t* at = panel + c * kChunk / 2 * kPanelCols + 16 * h;
      for (int d = 0; d < 16; ++d) {
        __m512i lo, hi;
        widen_codes<true>(r[d], lo, hi);
        _mm512_storeu_si512(at + (2 * d) * kPanelCols, _mm512_permutex2var_epi32(lo, even, hi));
        _mm512_storeu_si512(at + (2 * d + 1) * kPanelCols, _mm512_permutex2var_epi32(lo, odd, hi));
      }
    }
  }
}

// Rows r0 .. r0 + R of the panel path: their products with one 128-K block's panel (pairs of
// it), the 32 sums of each row times the row's A scale and each column's W scale (scales) into
// the row's 32 totals.
template <int R>
[[METRALE_E4M3_TARGET]] void panel_rows(const std::uint16_t* a, std::int64_t kpad,
                                        const std::uint32_t* panel, std::int64_t pairs,
                                        const float* a_scales, const float* scales, float* totals) {
  __m512 c[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  w4a16::detail::add_panel_products<R>(a, kpad, panel, 2 * pairs, c);
  const __m512 s0 = _mm512_load_ps(scales), s1 = _mm512_load_ps(scales + 16);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 sa = _mm512_set1_ps(a_scales[r]);
    float* t = totals + r * kPanelCols;
    _mm512_storeu_ps(t, _mm512_fmadd_ps(c[r][0], _mm512_mul_ps(sa, s0), _mm512_loadu_ps(t)));
    _mm512_storeu_ps(t + 16,
                     _mm512_fmadd_ps(c[r][1], _mm512_mul_ps(sa, s1), _mm512_loadu_ps(t + 16)));
  }
}

template <int R>
[[METRALE_E4M3_TARGET]] void panel_rows_up_to(int rows, const std::uint16_t* a, std::int64_t kpad,
                                              const std::uint32_t* panel, std::int64_t pairs,
                                              const float* a_scales, const float* scales,
                                              float* totals) {
  if constexpr (R > 1) {
    if (rows < R) {
      return panel_rows_up_to<R - 1>(rows, a, kpad, panel, pairs, a_scales, scales, totals);
    }
  }
  panel_rows<R>(a, kpad, panel, pairs, a_scales, scales, totals);
}

// More rows than a row tile: per 32 columns, each 128-K block widened once into a panel that
// every row tile of kPanelRows then multiplies as the tiled kernels do, one broadcast pair of A
// against 32 columns (Note [E4M3 as BF16]); each block's sums times their scales into 32 totals
// a row.
[[METRALE_E4M3_TARGET]] void panel_path(const DenseParams& p, const std::uint16_t* aw,
                                        std::int64_t kpad, std::int64_t n0, std::int64_t n1) {
  const auto* sa = reinterpret_cast<const float*>(p.a_scales);
  const auto* sb = reinterpret_cast<const float*>(p.b_scales);
  const auto* bias = reinterpret_cast<const std::uint16_t*>(p.bias);
  const std::int64_t lda = a_scales_ld(p), ldb = dense_b_scales_ld(p.k);
  thread_local std::vector<std::uint32_t> panel;
  thread_local std::vector<float> totals, row_scales;
  panel.resize(static_cast<std::size_t>(kDenseScaleBlock / 2 * kPanelCols));
  row_scales.resize(static_cast<std::size_t>(p.m));
  alignas(64) float col_scales[kPanelCols];
  for (std::int64_t n = n0; n < n1; n += kPanelCols) {
    const std::int64_t live = std::min<std::int64_t>(kPanelCols, n1 - n);
    totals.assign(static_cast<std::size_t>(p.m * kPanelCols), 0.0f);
    for (std::int64_t kb = 0; kb < dense_scale_blocks(p.k); ++kb) {
      const std::int64_t k0 = kb * kDenseScaleBlock;
      const std::int64_t len = std::min(kDenseScaleBlock, p.k - k0);
      const std::int64_t pairs = (len + kChunk - 1) / kChunk * kChunk / 2;
      pack_block(p, n, live, k0, len, panel.data());
      for (std::int64_t c = 0; c < kPanelCols; ++c) {
        col_scales[c] = c < live ? sb[((n + c) / kDenseScaleBlock) * ldb + kb] : 0.0f;
      }
      for (std::int64_t m = 0; m < p.m; ++m) row_scales[m] = sa[kb * lda + m];
      for (std::int64_t r0 = 0; r0 < p.m; r0 += kPanelRows) {
        const auto rows = static_cast<int>(std::min<std::int64_t>(kPanelRows, p.m - r0));
        panel_rows_up_to<kPanelRows>(rows, aw + r0 * kpad + k0, kpad, panel.data(), pairs,
                                     row_scales.data() + r0, col_scales,
                                     totals.data() + r0 * kPanelCols);
      }
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      for (std::int64_t j = 0; j < live; ++j) {
        float v = totals[static_cast<std::size_t>(m * kPanelCols + j)];
        if (bias != nullptr) v += num::bf16_to_f32(bias[n + j]);
        store_c(p, static_cast<std::size_t>(m * p.n + n + j), v);
      }
    }
  }
}

// A [M, K] widened into aw (kpad apart, zero past K, where B's tail is zero too), in the order
// of widen_codes<kKOrder>.
template <bool kKOrder>
[[METRALE_E4M3_TARGET]] void widen_a(const DenseParams& p, std::int64_t kpad, std::uint16_t* aw) {
  const auto* a = reinterpret_cast<const std::uint8_t*>(p.a);
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t k = 0; k < p.k; k += kChunk) {
      __m512i lo, hi;
      widen64<kKOrder>(a + m * p.k + k, p.k - k, lo, hi);
      _mm512_storeu_si512(aw + m * kpad + k, lo);
      _mm512_storeu_si512(aw + m * kpad + k + 32, hi);
    }
  }
}

// One K pair of a panel-layout panel's 32 columns (64 codes, fp8_panel_layout.h) as BF16 pairs:
// lo holds columns 0-15, hi 16-31, a dword each. The layout puts each column's codes where VBMI's
// in-lane interleave leaves them; the arithmetic widening, which keeps K order, first gathers the
// quadwords of columns 0-15 (0, 2, 4, 6) into the low half.
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline void widen_panel_pair(__m512i codes, __m512i& lo,
                                                                         __m512i& hi) {
#if METRALE_E4M3_VBMI
  widen_codes<false>(codes, lo, hi);
#else
  const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
  widen_codes<true>(_mm512_permutexvar_epi64(order, codes), lo, hi);
#endif
}

// Rows r0 .. r0 + R against one 128-K block of a panel (`pairs` K pairs of 64 bytes at codes),
// streamed from memory with the decode kernel's read-ahead (Note [L2 read-ahead distance]): each
// pair widened once in registers and multiplied by every row's broadcast A pair (a: the rows'
// pairs, apairs apart), two independent sets of sums per row with one or two rows; the 32 sums of
// each row times its A scale and the block's W scale into the row's 32 totals. kKeep: the widened
// pairs also stored into keep (the tiled kernels' panel, for the row tiles after this one).
template <int R, bool kKeep>
[[METRALE_E4M3_TARGET]] void packed_block_rows(const std::uint8_t* codes, std::int64_t pairs,
                                               const std::uint32_t* a, std::int64_t apairs,
                                               const float* a_scales, float w_scale, float* totals,
                                               std::uint32_t* keep) {
  constexpr int kSets = R <= 2 ? 2 : 1;
  __m512 c[kSets][R][2];
#pragma GCC unroll 2
  for (int s = 0; s < kSets; ++s) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) c[s][r][0] = c[s][r][1] = _mm512_setzero_ps();
  }
  for (std::int64_t q = 0; q < pairs; q += kSets) {  // pairs: a multiple of 8 (K of 16)
#pragma GCC unroll 2
    for (int s = 0; s < kSets; ++s) {
      const std::uint8_t* at = codes + (q + s) * fp8_panels::kPairBytes;
      // Addresses as integers: past the panel's end a prefetch is harmless, arithmetic is not.
      const auto ahead = reinterpret_cast<std::uintptr_t>(at);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + kPrefetchL1), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + kPrefetchL2), _MM_HINT_T1);
      __m512i lo, hi;
      widen_panel_pair(_mm512_loadu_si512(at), lo, hi);
      if constexpr (kKeep) {
        _mm512_store_si512(keep + (q + s) * fp8_panels::kCols, lo);
        _mm512_store_si512(keep + (q + s) * fp8_panels::kCols + 16, hi);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const auto x = reinterpret_cast<__m512bh>(
            _mm512_broadcastd_epi32(_mm_loadu_si32(a + r * apairs + q + s)));
        c[s][r][0] = _mm512_dpbf16_ps(c[s][r][0], reinterpret_cast<__m512bh>(lo), x);
        c[s][r][1] = _mm512_dpbf16_ps(c[s][r][1], reinterpret_cast<__m512bh>(hi), x);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_set1_ps(a_scales[r] * w_scale);
    float* t = totals + r * fp8_panels::kCols;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512 sum = c[0][r][h];
      if constexpr (kSets == 2) sum = _mm512_add_ps(sum, c[1][r][h]);
      _mm512_storeu_ps(t + 16 * h, _mm512_fmadd_ps(sum, scale, _mm512_loadu_ps(t + 16 * h)));
    }
  }
}

template <int R>
[[METRALE_E4M3_TARGET]] void packed_block_rows_up_to(int rows, const std::uint8_t* codes,
                                                     std::int64_t pairs, const std::uint32_t* a,
                                                     std::int64_t apairs, const float* a_scales,
                                                     float w_scale, float* totals,
                                                     std::uint32_t* keep) {
  if constexpr (R > 1) {
    if (rows < R) {
      return packed_block_rows_up_to<R - 1>(rows, codes, pairs, a, apairs, a_scales, w_scale,
                                            totals, keep);
    }
  }
  if (keep != nullptr) {
    return packed_block_rows<R, true>(codes, pairs, a, apairs, a_scales, w_scale, totals, keep);
  }
  packed_block_rows<R, false>(codes, pairs, a, apairs, a_scales, w_scale, totals, keep);
}

// C[:, n0:n1] of p with B in the panel layout (n0 a multiple of 32, K of 16): A widened once in K
// order; per panel and 128-K block, row tiles of kPanelRows: the first widens the block's pairs
// in registers as it reads them, the others read them widened from L1; 32 totals a row (Note
// [E4M3 panels]).
[[METRALE_E4M3_TARGET]] void gemm_panels(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  const std::int64_t kpad = (p.k + kChunk - 1) / kChunk * kChunk;
  thread_local std::vector<std::uint16_t> aw;
  thread_local std::vector<float> totals;
  aw.assign(static_cast<std::size_t>(p.m * kpad), 0);
  widen_a<true>(p, kpad, aw.data());
  const auto* a = reinterpret_cast<const std::uint32_t*>(aw.data());
  const auto* b = reinterpret_cast<const std::uint8_t*>(p.b);
  const auto* sa = reinterpret_cast<const float*>(p.a_scales);
  const auto* sb = reinterpret_cast<const float*>(p.b_scales);
  const auto* bias = reinterpret_cast<const std::uint16_t*>(p.bias);
  const std::int64_t lda = a_scales_ld(p), ldb = dense_b_scales_ld(p.k);
  alignas(64) std::uint32_t wide[kDenseScaleBlock / 2 * fp8_panels::kCols];
  alignas(64) float scales[fp8_panels::kCols];
  for (std::int64_t n = n0; n < n1; n += fp8_panels::kCols) {
    const std::int64_t live = std::min(fp8_panels::kCols, n1 - n);
    const std::uint8_t* panel = b + fp8_panels::offset(n, 0, p.k);
    totals.assign(static_cast<std::size_t>(p.m * fp8_panels::kCols), 0.0f);
    for (std::int64_t kb = 0; kb < dense_scale_blocks(p.k); ++kb) {
      const std::int64_t k0 = kb * kDenseScaleBlock;
      const std::int64_t pairs = std::min(kDenseScaleBlock, p.k - k0) / 2;
      const float w_scale = sb[(n / kDenseScaleBlock) * ldb + kb];
      const std::uint8_t* block = panel + k0 / 2 * fp8_panels::kPairBytes;
      // The first row tile widens the block in registers as it streams it; with more rows than
      // a tile, it keeps the widened pairs in L1 for the other tiles, as re-widening them per
      // tile would cost a vector operation for every two products they feed.
      const bool more = p.m > kPanelRows;
      packed_block_rows_up_to<kPanelRows>(static_cast<int>(std::min<std::int64_t>(kPanelRows, p.m)),
                                          block, pairs, a + k0 / 2, kpad / 2, sa + kb * lda,
                                          w_scale, totals.data(), more ? wide : nullptr);
      if (!more) continue;
      std::fill(scales, scales + fp8_panels::kCols, w_scale);
      for (std::int64_t r0 = kPanelRows; r0 < p.m; r0 += kPanelRows) {
        const auto rows = static_cast<int>(std::min<std::int64_t>(kPanelRows, p.m - r0));
        panel_rows_up_to<kPanelRows>(rows, aw.data() + r0 * kpad + k0, kpad, wide, pairs,
                                     sa + kb * lda + r0, scales,
                                     totals.data() + r0 * fp8_panels::kCols);
      }
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      for (std::int64_t j = 0; j < live; ++j) {
        float v = totals[static_cast<std::size_t>(m * fp8_panels::kCols + j)];
        if (bias != nullptr) v += num::bf16_to_f32(bias[n + j]);
        store_c(p, static_cast<std::size_t>(m * p.n + n + j), v);
      }
    }
  }
}

// C[:, n0:n1] of p: A widened once per call in the order of B's widening on its path, then the
// row-tile path up to kRowTile rows, the panel path above.
[[METRALE_E4M3_TARGET]] void gemm(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  const std::int64_t kpad = (p.k + kChunk - 1) / kChunk * kChunk;
  thread_local std::vector<std::uint16_t> aw;
  aw.assign(static_cast<std::size_t>(p.m * kpad), 0);
  if (p.m > kRowTile) {
    widen_a<true>(p, kpad, aw.data());
    panel_path(p, aw.data(), kpad, n0, n1);
    return;
  }
  widen_a<false>(p, kpad, aw.data());
  rows_up_to<kRowTile>(static_cast<int>(p.m), p, aw.data(), kpad, 0, n0, n1);
}

}  // namespace metrale::cpu::blas::METRALE_E4M3_VARIANT
