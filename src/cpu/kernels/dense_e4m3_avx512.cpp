// The block-scaled FP8 dense GEMM on AVX-512 BF16 (dense_e4m3.h): every E4M3 code is exact in
// BF16, and vdpbf16ps multiplies BF16 pairs exactly and adds in FP32, so the kernel widens codes
// to BF16 in registers and sums their products as the reference does, only in another order.
// See Note [E4M3 as BF16] in docs/NOTES.md.
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu/kernels/dense_e4m3.h"
#include "cpu/kernels/dense_store.h"
#include "cpu/kernels/w4a16_shared.h"
#include "metrale/dense_gemm.h"

// As in the w4a16 kernels: vector arguments of always-inlined helpers (-Wpsabi), and GCC 12's
// _mm512_reduce_add_ps, whose header leaves a lane "maybe uninitialized".
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::blas {
namespace {

constexpr std::int64_t kChunk = 32;  // K per vector: 32 BF16, 16 pairs
constexpr int kRowTile = 8;          // up to this many rows, B is widened in registers
// Above it, B's block is widened into a buffer and read by register tiles of rows x columns.
constexpr int kPanelRows = 4, kColTile = 4;
constexpr std::int64_t kBlockChunks = 128 / kChunk;  // chunks of one scale block
// How far ahead in a row of B a line is fetched into L1 (the weights stream from DRAM).
constexpr std::int64_t kPrefetchBytes = 1024;

// BF16 bits of E4M3 codes 0-7 (±0 and the subnormals, m·2^-9), which the exponent rebias below
// does not cover; vpermw reads the low five bits of the index, all zero above 7 here.
alignas(64) constexpr std::uint16_t kSubnormalBf16[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                                          0x3C00, 0x3C20, 0x3C40, 0x3C60};

// 32 E4M3 codes (zero-extended to words) as BF16: the magnitude's exponent rebiased from 7 to
// 127 and its 3 mantissa bits moved to the top of BF16's 7, codes 0-7 from the table, the sign
// moved to bit 15, and the NaN codes (0x7F, 0xFF) as a quiet NaN.
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline __m512i widen(__m512i words) {
  const __m512i mag = _mm512_and_si512(words, _mm512_set1_epi16(0x7F));
  __m512i bf = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3C00));
  const __mmask32 small = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  bf = _mm512_mask_permutexvar_epi16(bf, small, mag, _mm512_load_si512(kSubnormalBf16));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F));
  bf = _mm512_mask_mov_epi16(bf, nan, _mm512_set1_epi16(0x7FC0));
  return _mm512_or_si512(bf,
                         _mm512_slli_epi16(_mm512_and_si512(words, _mm512_set1_epi16(0x80)), 8));
}

// The codes [at, at + len) (len ≤ 32) as BF16, zero beyond len.
[[METRALE_TARGET_AVX512BF16, gnu::always_inline]] inline __m512i load_widened(
    const std::uint8_t* at, std::int64_t len) {
  const __mmask32 keep = len >= kChunk ? ~__mmask32{0} : (__mmask32{1} << len) - 1;
  return widen(_mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(keep, at)));
}

// Rows r0 .. r0 + R of C[:, n0:n1]: for each column and 128-K block, B's codes widened once and
// multiplied with the R rows of widened A (aw, kpad apart); each row's block sum, still in 16
// lanes, times its two scales into the row's total, which is reduced once per column.
template <int R>
[[METRALE_TARGET_AVX512BF16]] void rows_of(const DenseParams& p, const std::uint16_t* aw,
                                           std::int64_t kpad, std::int64_t r0, std::int64_t n0,
                                           std::int64_t n1) {
  const auto* b = reinterpret_cast<const std::uint8_t*>(p.b);
  const auto* sa = reinterpret_cast<const float*>(p.a_scales);
  const auto* sb = reinterpret_cast<const float*>(p.b_scales);
  const auto* bias = reinterpret_cast<const std::uint16_t*>(p.bias);
  const std::int64_t kblocks = dense_scale_blocks(p.k);
  const std::int64_t lda = dense_a_scales_ld(p.m), ldb = dense_b_scales_ld(p.k);
  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* brow = b + n * p.k;
    const float* sbrow = sb + (n / kDenseScaleBlock) * ldb;
    __m512 total[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (std::int64_t kb = 0; kb < kblocks; ++kb) {
      const std::int64_t k0 = kb * kDenseScaleBlock;
      const std::int64_t len = std::min(kDenseScaleBlock, p.k - k0);
      __m512 acc[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      for (std::int64_t c = 0; c * kChunk < len; ++c) {
        const std::int64_t k = k0 + c * kChunk;
        const auto ahead = reinterpret_cast<std::uintptr_t>(brow + k) + kPrefetchBytes;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        const auto w = reinterpret_cast<__m512bh>(load_widened(brow + k, len - c * kChunk));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const auto x = reinterpret_cast<__m512bh>(_mm512_loadu_si512(aw + (r0 + r) * kpad + k));
          acc[r] = _mm512_dpbf16_ps(acc[r], w, x);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float scale = sa[kb * lda + r0 + r] * sbrow[kb];
        total[r] = _mm512_fmadd_ps(acc[r], _mm512_set1_ps(scale), total[r]);
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
[[METRALE_TARGET_AVX512BF16]] void rows_up_to(int rows, const DenseParams& p,
                                              const std::uint16_t* aw, std::int64_t kpad,
                                              std::int64_t r0, std::int64_t n0, std::int64_t n1) {
  if constexpr (R > 1) {
    if (rows < R) return rows_up_to<R - 1>(rows, p, aw, kpad, r0, n0, n1);
  }
  rows_of<R>(p, aw, kpad, r0, n0, n1);
}

// Rows r0 .. r0 + R of the panel path: each 4-column group of the widened block bw (chunk-major
// per column, kBlockChunks chunks of 32 K) against R rows of A, its block sums times their two
// scales into the 16-lane totals (cols_pad per row).
template <int R>
[[METRALE_TARGET_AVX512BF16]] void panel_rows(const DenseParams& p, const std::uint16_t* aw,
                                              std::int64_t kpad, const std::uint16_t* bw,
                                              float* totals, std::int64_t cols,
                                              std::int64_t cols_pad, std::int64_t kb,
                                              std::int64_t r0, std::int64_t n0) {
  const auto* sa = reinterpret_cast<const float*>(p.a_scales);
  const auto* sb = reinterpret_cast<const float*>(p.b_scales);
  const std::int64_t lda = dense_a_scales_ld(p.m), ldb = dense_b_scales_ld(p.k);
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
      __m512bh w[kColTile];
#pragma GCC unroll 4
      for (int j = 0; j < kColTile; ++j) {
        w[j] = reinterpret_cast<__m512bh>(
            _mm512_loadu_si512(bw + ((c0 + j) * kBlockChunks + c) * kChunk));
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const auto x =
            reinterpret_cast<__m512bh>(_mm512_loadu_si512(aw + (r0 + r) * kpad + k0 + c * kChunk));
#pragma GCC unroll 4
        for (int j = 0; j < kColTile; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], x);
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
[[METRALE_TARGET_AVX512BF16]] void panel_rows_up_to(int rows, const DenseParams& p,
                                                    const std::uint16_t* aw, std::int64_t kpad,
                                                    const std::uint16_t* bw, float* totals,
                                                    std::int64_t cols, std::int64_t cols_pad,
                                                    std::int64_t kb, std::int64_t r0,
                                                    std::int64_t n0) {
  if constexpr (R > 1) {
    if (rows < R) {
      return panel_rows_up_to<R - 1>(rows, p, aw, kpad, bw, totals, cols, cols_pad, kb, r0, n0);
    }
  }
  panel_rows<R>(p, aw, kpad, bw, totals, cols, cols_pad, kb, r0, n0);
}

// More rows than a row tile: each 128-K block of B's columns widened once into a buffer that
// every row then reads, instead of once per row tile (Note [E4M3 as BF16]).
[[METRALE_TARGET_AVX512BF16]] void panel_path(const DenseParams& p, const std::uint16_t* aw,
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
        _mm512_storeu_si512(bw.data() + (j * kBlockChunks + c) * kChunk,
                            load_widened(at + c * kChunk, len - c * kChunk));
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

}  // namespace

[[METRALE_TARGET_AVX512BF16]] void gemm_e4m3_block128_avx512bf16(const DenseParams& p,
                                                                 std::int64_t n0, std::int64_t n1) {
  const auto* a = reinterpret_cast<const std::uint8_t*>(p.a);
  const std::int64_t kpad = (p.k + kChunk - 1) / kChunk * kChunk;
  // A widened once per block of columns, zero past K (B's tail is zero there too).
  thread_local std::vector<std::uint16_t> aw;
  aw.assign(static_cast<std::size_t>(p.m * kpad), 0);
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t k = 0; k < p.k; k += kChunk) {
      _mm512_storeu_si512(aw.data() + m * kpad + k, load_widened(a + m * p.k + k, p.k - k));
    }
  }
  if (p.m > kRowTile) {
    panel_path(p, aw.data(), kpad, n0, n1);
    return;
  }
  const auto rows = static_cast<int>(p.m);
  rows_up_to<kRowTile>(rows, p, aw.data(), kpad, 0, n0, n1);
}

}  // namespace metrale::cpu::blas
