// INT4 weights in the panel layout on processors with AVX-512 BF16 (Note [INT4 weights], Note [CPU
// panel layout]): the FP4 panel kernels' structure with a table of code − 8. Per 32 columns (two
// groups of 16), K in chunks of 256; register tiles of up to six rows decode the chunk's lines
// themselves (panel_sums_avx512.h) and keep each block's sum apart (32, 64 or 128 K, inside one
// group), then add sum·s and, for asymmetric weights, Σa·(8 − zero)·s per row and column. Both
// products are exact in FP32, as in the source layout's kernels; the sums round as the INT4
// tolerance derives (toolkit/gemm_tolerance.h, "INT4"). One kernel serves the decode route and
// the tiled route's rows up to kInt4PanelsTiledMaxM (int4_portable.cpp); past it a panel decoded
// once per block pays (int4_tiled.cpp reads the lines too).
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "cpu/kernels/int4_cpu.h"
#include "cpu/kernels/int4_scales_avx512.h"
#include "cpu/kernels/int4_shared.h"
#include "cpu/kernels/panel_sums_avx512.h"
#include "cpu/kernels/w4a16_shared.h"
#include "kernels/panel_layout.h"

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16::detail {
namespace {

namespace pl = panel_layout;

constexpr std::int64_t kCols = 2 * pl::kGroupCols;  // columns per pass: two groups
constexpr std::int64_t kChunkK = 256;  // a chunk's lines are 8 KiB: later row tiles read them in L1
// Rows per register tile, as panels_tiled.cpp: 6 × 2 accumulators and 6 × 2 block sums beside
// the two lines, two pair vectors, A's broadcast and the table.
constexpr std::int64_t kRowTile = 6;

// K per block sum: the largest of 128, 64 and 32 that divides the group (K itself for one scale
// per row), so a block lies in one group; fewer blocks mean fewer scalings per product.
std::int64_t block_k_of(std::int64_t group) {
  return group % 128 == 0 ? 128 : group % 64 == 0 ? 64 : pl::kInt4BlockK;
}

// What a register tile reads besides A and the lines: per block b of its chunk, the 32 columns'
// scales at scales + b * 32 and offsets (8 − zero)·s alike, and row r's Σa over the block at
// sums[r * ld_sums + b].
struct BlockSide {
  const float* scales;
  const float* offsets;
  const float* sums;
  std::int64_t ld_sums;
};

// acc[MR rows, 32] (row stride 32) += Σ over blocks [0, blocks) of (A[MR rows, block b] · the
// block's lines)·s + Σa·(8 − zero)·s, where a points at row 0's first k of the chunk and line[i]
// at group i's first line of it.
template <int MR, int LPB, bool kPrefetch, bool kZeros>
[[METRALE_TARGET_AVX512BF16]] void tile(const std::uint16_t* a, std::int64_t lda,
                                        const std::uint8_t* const line[2], const BlockSide& side,
                                        std::int64_t blocks, float* acc) {
  const __m512i lut = _mm512_load_si512(int4_bf16_lut().words);
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
    const __m512 s0 = _mm512_loadu_ps(side.scales + b * kCols);
    const __m512 s1 = _mm512_loadu_ps(side.scales + b * kCols + pl::kGroupCols);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      c[r][0] = _mm512_fmadd_ps(sum[r][0], s0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(sum[r][1], s1, c[r][1]);
    }
    if constexpr (kZeros) {
      const __m512 o0 = _mm512_loadu_ps(side.offsets + b * kCols);
      const __m512 o1 = _mm512_loadu_ps(side.offsets + b * kCols + pl::kGroupCols);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 x = _mm512_set1_ps(side.sums[r * side.ld_sums + b]);
        c[r][0] = _mm512_fmadd_ps(x, o0, c[r][0]);
        c[r][1] = _mm512_fmadd_ps(x, o1, c[r][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc + r * kCols, c[r][0]);
    _mm512_storeu_ps(acc + r * kCols + pl::kGroupCols, c[r][1]);
  }
}

using Tile = void (*)(const std::uint16_t*, std::int64_t, const std::uint8_t* const[2],
                      const BlockSide&, std::int64_t, float*);

// tiles[r - 1] runs r rows; the first row tile of a chunk prefetches the codes ahead.
template <int LPB, bool kPrefetch, bool kZeros>
constexpr Tile kTiles[kRowTile] = {
    tile<1, LPB, kPrefetch, kZeros>, tile<2, LPB, kPrefetch, kZeros>,
    tile<3, LPB, kPrefetch, kZeros>, tile<4, LPB, kPrefetch, kZeros>,
    tile<5, LPB, kPrefetch, kZeros>, tile<6, LPB, kPrefetch, kZeros>};

// sums[m * blocks + b]: row m's Σa over block b (block_k of K each), in FP32.
[[METRALE_TARGET_AVX512BF16]] void block_sums(const GemmParams& p, std::int64_t block_k,
                                              std::vector<float>& sums) {
  const auto* a = at<const std::uint16_t>(p.a);
  const std::int64_t blocks = p.k / block_k;
  sums.resize(static_cast<std::size_t>(p.m * blocks));
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::uint16_t* src = a + m * p.k + b * block_k;
      __m512 t = _mm512_setzero_ps();
      for (std::int64_t j = 0; j < block_k; j += 16) {  // block_k is a multiple of 32
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
        t = _mm512_add_ps(t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
      sums[static_cast<std::size_t>(m * blocks + b)] = _mm512_reduce_add_ps(t);
    }
  }
}

template <int LPB, bool kZeros>
void columns(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Int4Weights w(p);
  constexpr std::int64_t kBlockK = LPB * pl::kLineK;
  const auto* a = at<const std::uint16_t>(p.a);
  const std::int64_t blocks_k = p.k / kBlockK, per_group = w.group / kBlockK;
  // Row tiles as even as 6-row tiles allow (as panels_tiled.cpp: the look-ups are per tile).
  const std::int64_t tiles = (p.m + kRowTile - 1) / kRowTile;
  thread_local std::vector<float> acc, scales, offsets, sums;
  acc.resize(static_cast<std::size_t>(p.m * kCols));
  scales.resize(static_cast<std::size_t>(w.groups * kCols));
  offsets.resize(scales.size());
  if constexpr (kZeros) block_sums(p, kBlockK, sums);
  // One row tile walks the whole K at once where the scales can be read in place (a chunk keeps
  // the lines in L1 for the next row tile, which one tile does not need); else chunks of 256.
  const std::int64_t chunk_k = tiles == 1 && per_group == 1 ? p.k : kChunkK;
  // A chunk's blocks' scales where a group spans several blocks (else read in place).
  alignas(64) float chunk_scales[kChunkK / kBlockK * kCols];
  alignas(64) float chunk_offsets[kChunkK / kBlockK * kCols];
  for (std::int64_t n = n0; n < n1; n += kCols) {
    const std::int64_t g = n / pl::kGroupCols;
    block_scales(w, n, std::min(kCols, n1 - n), kCols, scales.data(), offsets.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k0 = 0; k0 < p.k; k0 += chunk_k) {
      const std::int64_t blocks = std::min(chunk_k, p.k - k0) / kBlockK, b0 = k0 / kBlockK;
      BlockSide side{scales.data() + b0 * kCols, offsets.data() + b0 * kCols,
                     kZeros ? sums.data() + b0 : nullptr, blocks_k};
      if (per_group > 1) {
        for (std::int64_t b = 0; b < blocks; ++b) {
          const std::int64_t from = (b0 + b) / per_group * kCols;
          std::copy_n(scales.data() + from, kCols, chunk_scales + b * kCols);
          if constexpr (kZeros)
            std::copy_n(offsets.data() + from, kCols, chunk_offsets + b * kCols);
        }
        side.scales = chunk_scales;
        side.offsets = chunk_offsets;
      }
      const std::int64_t t0 = k0 / pl::kLineK;
      const std::uint8_t* line[2] = {w.codes + pl::line_offset(w.k, g, t0),
                                     w.codes + pl::line_offset(w.k, g + 1, t0)};
      for (std::int64_t i = 0; i < tiles; ++i) {
        const std::int64_t m0 = p.m * i / tiles, rows = p.m * (i + 1) / tiles - m0;
        const Tile* run = i == 0 ? kTiles<LPB, true, kZeros> : kTiles<LPB, false, kZeros>;
        BlockSide rows_side = side;
        if constexpr (kZeros) rows_side.sums = side.sums + m0 * blocks_k;
        run[rows - 1](a + m0 * p.k + k0, p.k, line, rows_side, blocks, acc.data() + m0 * kCols);
      }
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      for (std::int64_t c = 0; c < std::min(kCols, n1 - n); ++c) {
        store(p, m, n + c, acc[static_cast<std::size_t>(m * kCols + c)]);
      }
    }
  }
}

template <int LPB>
void columns_of(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  if (p.flags & kGemmZeroPoints) return columns<LPB, true>(p, n0, n1);
  columns<LPB, false>(p, n0, n1);
}

}  // namespace

void int4_panels_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  switch (block_k_of(p.group)) {
    case 128:
      return columns_of<16>(p, n0, n1);
    case 64:
      return columns_of<8>(p, n0, n1);
    default:
      return columns_of<4>(p, n0, n1);
  }
}

}  // namespace metrale::cpu::w4a16::detail
