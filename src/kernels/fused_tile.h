// The index math of gemm_fused (cuda/kernels/fused_sm90.cuh), the prefill GEMM on weights in
// the decode layout (kernels/decode_layout.h): C^T = W · A^T on wgmma with the weights as the A
// operand from registers (the RS form) and the activations as B from shared memory. Everything
// here is __host__ __device__ so that host tests (tests/kernels/fused_tile_test.cpp) check, by
// the PTX ISA's rules, what no GPU here runs.
//
// The roles: a block has one producer warpgroup (bulk copies of the packed weights; the
// activations, permuted, through registers) and two consumer warpgroups, each of which owns 64
// weight rows (m64: two decode tiles of 32) and all kTokens tokens of the block (wgmma N).
//
// Why the activations are permuted: a decode-layout word of lane (g, t) holds K 32 t + 4 s ..
// 32 t + 4 s + 3 of MMA step s, and wgmma's A fragment says which MMA k (0..15) each register
// half is. The MMA sums its 16 k in any order, so B must carry the same permutation of K: its
// MMA k kk of step s is physical K fused_physical_k(s, kk). The permutation moves 4-byte pairs
// (two BF16), below the 16-byte granule of TMA and cp.async.cg, so the producer threads load
// 16-byte chunks into registers and store them transposed (fused_act_chunk_offset).
#pragma once

#include <cstdint>

#include "kernels/decode_layout.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"  // METRALE_HD

namespace metrale::fused {

namespace dl = metrale::decode_layout;

inline constexpr int kConsumers = 2;                         // warpgroups that multiply
inline constexpr int kThreads = 128 * (kConsumers + 1);      // + the producer warpgroup
inline constexpr int kRowsPerConsumer = 64;                  // wgmma M
inline constexpr int kRows = kRowsPerConsumer * kConsumers;  // weight rows (C columns) a block
inline constexpr int kTokens = 128;                          // wgmma N: C rows a block
inline constexpr int kTilesPerBlock = kRows / dl::kTileN;    // decode tiles of 32 rows
inline constexpr int kKBlock = dl::kBlockK;                  // K a stage: one decode K block
inline constexpr int kSteps = kKBlock / 16;                  // wgmma k16 steps a stage
inline constexpr int kStages = 4;

// One stage in shared memory: the activations (two 64-K halves of kTokens 128-byte swizzled
// rows), then each decode tile's codes (2 KiB) and scale codes (256 bytes: NVFP4's 8 a lane;
// MXFP4 uses the first 128).
inline constexpr int kActHalfBytes = kTokens * 128;
inline constexpr int kActBytes = 2 * kActHalfBytes;
inline constexpr int kCodeOffset = kActBytes;
inline constexpr int kScaleSlotBytes = dl::kLanes * 8;
inline constexpr int kScaleOffset = kCodeOffset + kTilesPerBlock * dl::kTileBlockBytes;
inline constexpr int kStageBytes = kScaleOffset + kTilesPerBlock * kScaleSlotBytes;
static_assert(kStageBytes % 1024 == 0, "stages start on the 1024-byte swizzle atom");
// Dynamic shared memory: the stages and slack to align them (the table and barriers are static).
inline constexpr int kSmemBytes = kStages * kStageBytes + 1024;

// ---- the weights: what a consumer thread loads and what its registers hold ----

// Physical K (0..127 in the K block) of MMA k `kk` (0..15) of step s: the A fragment's lane t
// holds kk = 2t, 2t+1 (pair 0) and 2t+8, 2t+9 (pair 1); the decode layout gives lane t the
// physical K 32t + 4s + j with j = 2 pair + (kk % 2) (tiles::decode_physical_k).
METRALE_HD int fused_physical_k(int s, int kk) {
  const int t = (kk % 8) / 2, j = 2 * (kk / 8) + kk % 2;
  return tiles::decode_physical_k(t, s, j);
}

// Byte, within a stage's codes, of the decode-layout word that thread `wtid` (0..127) of
// consumer warpgroup `wg` dequantizes into its A fragment of step s: warp w of the warpgroup
// owns rows 16 w .. 16 w + 15 of the warpgroup's 64, that is row tile w % 2 of decode tile
// 2 wg + w / 2.
METRALE_HD int fused_word_byte(int wg, int wtid, int s) {
  const int warp = wtid / 32, lane = wtid % 32;
  const int tile = 2 * wg + warp / 2, rt = warp % 2;
  return tile * dl::kTileBlockBytes + (s / 2) * (dl::kLanes * dl::kChunkBytes) +
         lane * dl::kChunkBytes + 4 * (2 * (s % 2) + rt);
}

// Byte, within a stage's scale codes, of the scale code for A register j (0..3) of thread wtid
// of warpgroup wg at step s: rows g + 8 (2 rt + j % 2), the step's 16-K group s / 4 (MXFP4: one
// code for the lane's 32 K). Matches decode_layout::scale_byte within a tile's slot.
METRALE_HD int fused_scale_byte(int wg, int wtid, int s, int j, bool mx) {
  const int warp = wtid / 32, lane = wtid % 32;
  const int tile = 2 * wg + warp / 2, rt = warp % 2, r = 2 * rt + j % 2;
  const int per = dl::scale_bytes_per_lane(mx);
  return tile * kScaleSlotBytes + lane * per + (mx ? r : 2 * r + s / 4);
}

// ---- the activations: the B tile in shared memory ----

// Byte offset, within a stage's activations, of token `token`'s element at physical K `k`
// (0..127): step s = (k % 32) / 4 is wgmma step s, which reads 64-K half s / 4 at MMA column
// 16 (s % 4) + kk, 128-byte swizzled (tiles::swizzle128).
METRALE_HD std::uint32_t fused_act_offset(int token, int k) {
  const int t = k / 32, s = (k % 32) / 4, j = k % 4;
  const int kk = 2 * t + 8 * (j / 2) + j % 2;
  const int col = 16 * (s % 4) + kk;
  return static_cast<std::uint32_t>((s / 4) * kActHalfBytes) +
         tiles::swizzle128(static_cast<std::uint32_t>(token), static_cast<std::uint32_t>(2 * col));
}

// The producer's unit: token `token`, source chunks t = 0..3 (physical K 32 t + 8 u .. + 7,
// 16 bytes each). Destination chunk d = 2 sh + p (step 2 u + sh, k pair p) gets word t from
// word d of source chunk t: a 4x4 transpose of 32-bit words. Its byte offset in the stage:
METRALE_HD std::uint32_t fused_act_chunk_offset(int token, int u, int d) {
  const int s = 2 * u + d / 2, p = d % 2;
  return static_cast<std::uint32_t>((s / 4) * kActHalfBytes) +
         tiles::swizzle128(static_cast<std::uint32_t>(token),
                           static_cast<std::uint32_t>(2 * (16 * (s % 4) + 8 * p)));
}

// The descriptor wgmma step s reads the B tile with (stage activations at shared address
// `act`, 1024-aligned): K-major, 128-byte swizzle, 8-row groups 1024 bytes apart; step s
// starts 32 bytes (16 BF16) further along its half's rows.
METRALE_HD std::uint64_t fused_b_desc(std::uint32_t act, int s) {
  return tiles::wgmma_desc_sw128(act + static_cast<std::uint32_t>((s / 4) * kActHalfBytes) +
                                 32u * static_cast<std::uint32_t>(s % 4));
}

// ---- the output ----

// Where accumulator register i of thread wtid of warpgroup wg lands: D of m64nN is row (weight
// row, a column of C) 16 w + g (+ 8), column (token, a row of C) 8 (i / 4) + 2 t + i % 2
// (tiles::wgmma_acc_row / _col, the PTX ISA's D fragment).
METRALE_HD int fused_out_col(int wg, int wtid, int i) {
  return kRowsPerConsumer * wg + tiles::wgmma_acc_row(wtid, i);
}
METRALE_HD int fused_out_row(int wtid, int i) {
  return tiles::wgmma_acc_col(wtid, i);
}

// ---- the tile schedule (persistent once the grid is smaller than the tiles) ----

// Tiles of the grid: M (tokens) in kTokens, N (weight rows) in kRows; tile index i is M tile
// i % m_tiles of N tile i / m_tiles, so neighbouring blocks share a weight tile in L2.
METRALE_HD std::int64_t fused_tiles(std::int64_t m, std::int64_t n) {
  return ((m + kTokens - 1) / kTokens) * ((n + kRows - 1) / kRows);
}

}  // namespace metrale::fused
