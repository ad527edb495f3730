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
#include "cpu/kernels/w4a16_shared.h"
#include "kernels/dense_params.h"
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
// Above it, B's block is widened into a buffer and read by register tiles of rows x columns.
constexpr int kPanelRows = 4, kColTile = 4;
constexpr std::int64_t kBlockChunks = 128 / kChunk;  // chunks of one scale block
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

// The codes [at, at + len) (len ≤ 64; zero beyond) as BF16 in two vectors: both bytes of each
// magnitude looked up, the sign ORed into the high byte, the bytes interleaved into words.
// vpunpck{l,h}bw work within 128-bit lanes, so lo holds codes 16j .. 16j + 7 and hi codes
// 16j + 8 .. 16j + 15 of each lane j: a K order A is widened in too, so the pairs still meet.
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline void widen64(const std::uint8_t* at,
                                                                std::int64_t len, __m512i& lo,
                                                                __m512i& hi) {
  const ByteTables& t = byte_tables();
  const __mmask64 keep = len >= kChunk ? ~__mmask64{0} : (__mmask64{1} << len) - 1;
  const __m512i codes = _mm512_maskz_loadu_epi8(keep, at);
  const __m512i top =
      _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), codes, _mm512_load_si512(t.hi + 64));
  const __m512i bottom =
      _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), codes, _mm512_load_si512(t.lo + 64));
  // top | (codes & 0x80): the sign into bit 15.
  const __m512i signed_top =
      _mm512_ternarylogic_epi32(top, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  lo = _mm512_unpacklo_epi8(bottom, signed_top);
  hi = _mm512_unpackhi_epi8(bottom, signed_top);
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

// The codes [at, at + len) (len ≤ 64; zero beyond) as BF16 in two vectors, in K order.
[[METRALE_E4M3_TARGET, gnu::always_inline]] inline void widen64(const std::uint8_t* at,
                                                                std::int64_t len, __m512i& lo,
                                                                __m512i& hi) {
  const __mmask64 keep = len >= kChunk ? ~__mmask64{0} : (__mmask64{1} << len) - 1;
  const __m512i codes = _mm512_maskz_loadu_epi8(keep, at);
  lo = widen(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(codes)));
  hi = widen(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(codes, 1)));
}
#endif

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
  widen64(brow + k, len, w0, w1);
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

// Rows r0 .. r0 + R of the panel path: each 4-column group of the widened block bw (chunk-major
// per column, kBlockChunks chunks of 64 K) against R rows of A, its block sums times their two
// scales into the 16-lane totals (cols_pad per row).
template <int R>
[[METRALE_E4M3_TARGET]] void panel_rows(const DenseParams& p, const std::uint16_t* aw,
                                        std::int64_t kpad, const std::uint16_t* bw, float* totals,
                                        std::int64_t cols, std::int64_t cols_pad, std::int64_t kb,
                                        std::int64_t r0, std::int64_t n0) {
  const auto* sa = reinterpret_cast<const float*>(p.a_scales);
  const auto* sb = reinterpret_cast<const float*>(p.b_scales);
  const std::int64_t lda = a_scales_ld(p), ldb = dense_b_scales_ld(p.k);
  const std::int64_t k0 = kb * kDenseScaleBlock;
  const std::int64_t chunks = (std::min(kDenseScaleBlock, p.k - k0) + kChunk - 1) / kChunk;
  for (std::int64_t c0 = 0; c0 < cols; c0 += kColTile) {
    __m512 acc[R][kColTile];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < kColTile; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    for (std::int64_t c = 0; c < chunks; ++c) {
      __m512bh w[kColTile][2];
#pragma GCC unroll 4
      for (int j = 0; j < kColTile; ++j) {
        const std::uint16_t* at = bw + ((c0 + j) * kBlockChunks + c) * kChunk;
        w[j][0] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(at));
        w[j][1] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(at + 32));
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const std::uint16_t* at = aw + (r0 + r) * kpad + k0 + c * kChunk;
        const auto x0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(at));
        const auto x1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(at + 32));
#pragma GCC unroll 4
        for (int j = 0; j < kColTile; ++j) {
          acc[r][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][j], w[j][0], x0), w[j][1], x1);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float a_scale = sa[kb * lda + r0 + r];
#pragma GCC unroll 4
      for (int j = 0; j < kColTile; ++j) {
        if (c0 + j >= cols) break;
        const std::int64_t n = n0 + c0 + j;
        const float scale = a_scale * sb[(n / kDenseScaleBlock) * ldb + kb];
        float* total = totals + ((r0 + r) * cols_pad + c0 + j) * 16;
        _mm512_storeu_ps(total,
                         _mm512_fmadd_ps(acc[r][j], _mm512_set1_ps(scale), _mm512_loadu_ps(total)));
      }
    }
  }
}

template <int R>
[[METRALE_E4M3_TARGET]] void panel_rows_up_to(int rows, const DenseParams& p,
                                              const std::uint16_t* aw, std::int64_t kpad,
                                              const std::uint16_t* bw, float* totals,
                                              std::int64_t cols, std::int64_t cols_pad,
                                              std::int64_t kb, std::int64_t r0, std::int64_t n0) {
  if constexpr (R > 1) {
    if (rows < R) {
      return panel_rows_up_to<R - 1>(rows, p, aw, kpad, bw, totals, cols, cols_pad, kb, r0, n0);
    }
  }
  panel_rows<R>(p, aw, kpad, bw, totals, cols, cols_pad, kb, r0, n0);
}

// More rows than a row tile: each 128-K block of B's columns widened once into a buffer that
// every row then reads, instead of once per row tile (Note [E4M3 as BF16]).
[[METRALE_E4M3_TARGET]] void panel_path(const DenseParams& p, const std::uint16_t* aw,
                                        std::int64_t kpad, std::int64_t n0, std::int64_t n1) {
  const auto* b = reinterpret_cast<const std::uint8_t*>(p.b);
  const auto* bias = reinterpret_cast<const std::uint16_t*>(p.bias);
  const std::int64_t cols = n1 - n0;
  const std::int64_t cols_pad = (cols + kColTile - 1) / kColTile * kColTile;
  thread_local std::vector<std::uint16_t> bw;
  thread_local std::vector<float> totals;
  bw.assign(static_cast<std::size_t>(cols_pad * kBlockChunks * kChunk), 0);
  totals.assign(static_cast<std::size_t>(p.m * cols_pad * 16), 0.0f);
  for (std::int64_t kb = 0; kb < dense_scale_blocks(p.k); ++kb) {
    const std::int64_t k0 = kb * kDenseScaleBlock;
    const std::int64_t len = std::min(kDenseScaleBlock, p.k - k0);
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::uint8_t* at = b + (n0 + j) * p.k + k0;
      for (std::int64_t c = 0; c * kChunk < len; ++c) {
        __m512i lo, hi;
        widen64(at + c * kChunk, len - c * kChunk, lo, hi);
        std::uint16_t* to = bw.data() + (j * kBlockChunks + c) * kChunk;
        _mm512_storeu_si512(to, lo);
        _mm512_storeu_si512(to + 32, hi);
      }
    }
    for (std::int64_t r0 = 0; r0 < p.m; r0 += kPanelRows) {
      const auto rows = static_cast<int>(std::min<std::int64_t>(kPanelRows, p.m - r0));
      panel_rows_up_to<kPanelRows>(rows, p, aw, kpad, bw.data(), totals.data(), cols, cols_pad, kb,
                                   r0, n0);
    }
  }
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t j = 0; j < cols; ++j) {
      float v = _mm512_reduce_add_ps(_mm512_loadu_ps(totals.data() + (m * cols_pad + j) * 16));
      if (bias != nullptr) v += num::bf16_to_f32(bias[n0 + j]);
      store_c(p, static_cast<std::size_t>(m * p.n + n0 + j), v);
    }
  }
}

// C[:, n0:n1] of p: A widened once per call (zero past K, where B's tail is zero too), then the
// row-tile path up to kRowTile rows, the panel path above.
[[METRALE_E4M3_TARGET]] void gemm(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  const auto* a = reinterpret_cast<const std::uint8_t*>(p.a);
  const std::int64_t kpad = (p.k + kChunk - 1) / kChunk * kChunk;
  thread_local std::vector<std::uint16_t> aw;
  aw.assign(static_cast<std::size_t>(p.m * kpad), 0);
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t k = 0; k < p.k; k += kChunk) {
      __m512i lo, hi;
      widen64(a + m * p.k + k, p.k - k, lo, hi);
      _mm512_storeu_si512(aw.data() + m * kpad + k, lo);
      _mm512_storeu_si512(aw.data() + m * kpad + k + 32, hi);
    }
  }
  if (p.m > kRowTile) {
    panel_path(p, aw.data(), kpad, n0, n1);
    return;
  }
  const auto rows = static_cast<int>(p.m);
  rows_up_to<kRowTile>(rows, p, aw.data(), kpad, 0, n0, n1);
}

}  // namespace metrale::cpu::blas::METRALE_E4M3_VARIANT
