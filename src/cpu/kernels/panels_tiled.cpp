// The tiled route over the panel layout (panels_tiled.h). Per 32 output columns (two groups),
// their whole K in chunks of 256: the chunk's block scales decoded to FP32 once, then register
// tiles of up to six rows decode the chunk's lines themselves (panel_sums_avx512.h) and scale
// each block's sums into their accumulators. No dequantized panel is written: the table
// look-ups share the shuffle port with A's broadcasts but not the dot products' pipes, so they
// overlap them, where a pack of scaled BF16 panels ran apart from the tiles (Note [CPU panel
// layout] in docs/NOTES.md has the figures).
#include "cpu/kernels/panels_tiled.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu/kernels/panel_sums_avx512.h"
#include "cpu/kernels/scales_avx512.h"
#include "cpu/kernels/w4a16_shared.h"
#include "kernels/panel_layout.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {
namespace {

namespace pl = panel_layout;

// Columns per pass (two groups) and K per chunk: a chunk's codes are 4 KiB, so every row tile
// after the first reads them from L1.
constexpr std::int64_t kCols = 2 * pl::kGroupCols;
constexpr std::int64_t kChunkK = 256;
// Rows per register tile: 6 × 2 accumulators and 6 × 2 block sums, with the two lines, two pair
// vectors, A's broadcast and the table, are 30 of the 32 zmm registers.
constexpr std::int64_t kRowTile = 6;

// acc[MR rows, 32] (row stride 32) += Σ over blocks [0, blocks) of scales[b] · (A[MR rows,
// block b] · the block's lines), where a points at row 0's first k of the chunk and line[i] at
// group i's first line of it; scales[b * 32 + c] is column c's.
template <int MR, int LPB, bool kPrefetch>
[[METRALE_TARGET_AVX512BF16]] void tile(const std::uint16_t* a, std::int64_t lda,
                                        const std::uint8_t* const line[2], const float* scales,
                                        std::int64_t blocks, float* acc) {
  const __m512i lut = _mm512_load_si512(tables().e2m1_bf16);
  __m512 c[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    c[r][0] = _mm512_loadu_ps(acc + r * kCols);
    c[r][1] = _mm512_loadu_ps(acc + r * kCols + pl::kGroupCols);
  }
  for (std::int64_t b = 0; b < blocks; ++b) {
    __m512 sum[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
    add_block<MR, LPB, kPrefetch>(a, lda, line, b * LPB, lut, sum);
    const __m512 s0 = _mm512_loadu_ps(scales + b * kCols);
    const __m512 s1 = _mm512_loadu_ps(scales + b * kCols + pl::kGroupCols);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      c[r][0] = _mm512_fmadd_ps(sum[r][0], s0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(sum[r][1], s1, c[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc + r * kCols, c[r][0]);
    _mm512_storeu_ps(acc + r * kCols + pl::kGroupCols, c[r][1]);
  }
}

using Tile = void (*)(const std::uint16_t*, std::int64_t, const std::uint8_t* const[2],
                      const float*, std::int64_t, float*);

// tiles[r - 1] runs r rows. The first row tile of a chunk prefetches the codes ahead (the rest
// find the chunk in L1).
template <int LPB, bool kPrefetch>
constexpr Tile kTiles[kRowTile] = {tile<1, LPB, kPrefetch>, tile<2, LPB, kPrefetch>,
                                   tile<3, LPB, kPrefetch>, tile<4, LPB, kPrefetch>,
                                   tile<5, LPB, kPrefetch>, tile<6, LPB, kPrefetch>};

// out[b * 32 + 16 i + c]: the FP32 scale of column c of group g + i for block b0 + b.
[[METRALE_TARGET_AVX512BF16]] void chunk_scales(const Weights& w, std::int64_t g, std::int64_t b0,
                                                std::int64_t count, float* out) {
  for (int i = 0; i < 2; ++i) {
    const std::uint8_t* sc = w.scales + pl::scale_offset(w.k, static_cast<int>(w.group), g + i, b0);
    for (std::int64_t b = 0; b < count; ++b) {
      _mm512_storeu_ps(out + b * kCols + i * pl::kGroupCols,
                       scales16_at(sc + b * pl::kGroupCols, w.mxfp4));
    }
  }
}

template <int LPB>
void columns(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Weights w(p);
  const auto* a = at<const std::uint16_t>(p.a);
  // Row tiles as even as 6-row tiles allow (16 rows: 5, 5, 6, not 6, 6, 4): a tile's table
  // look-ups are per tile, so a short one pays them over fewer rows.
  const std::int64_t tiles = (p.m + kRowTile - 1) / kRowTile;
  thread_local std::vector<float> acc;
  acc.resize(static_cast<std::size_t>(p.m * kCols));
  alignas(64) float scales[kChunkK / num::kNvfp4Group * kCols];
  for (std::int64_t n = n0; n < n1; n += kCols) {
    const std::int64_t g = n / pl::kGroupCols;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k0 = 0; k0 < p.k; k0 += kChunkK) {
      const std::int64_t blocks = std::min(kChunkK, p.k - k0) / w.group;
      chunk_scales(w, g, k0 / w.group, blocks, scales);
      const std::int64_t t0 = k0 / pl::kLineK;
      const std::uint8_t* line[2] = {w.codes + pl::line_offset(w.k, g, t0),
                                     w.codes + pl::line_offset(w.k, g + 1, t0)};
      for (std::int64_t i = 0; i < tiles; ++i) {
        const std::int64_t m0 = p.m * i / tiles, rows = p.m * (i + 1) / tiles - m0;
        const Tile* run = i == 0 ? kTiles<LPB, true> : kTiles<LPB, false>;
        run[rows - 1](a + m0 * p.k + k0, p.k, line, scales, blocks, acc.data() + m0 * kCols);
      }
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      for (std::int64_t c = 0; c < std::min(kCols, n1 - n); ++c)
        store(p, m, n + c, acc[m * kCols + c]);
    }
  }
}

}  // namespace

void panels_tiled_avx512bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  if (p.flags & kGemmMxfp4) {
    columns<num::kMxfp4Group / pl::kLineK>(p, n0, n1);
  } else {
    columns<num::kNvfp4Group / pl::kLineK>(p, n0, n1);
  }
}

}  // namespace metrale::cpu::w4a16::detail
