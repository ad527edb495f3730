// The index math of the Hopper w4a16 kernels: tile sizes, which K element a lane's register
// holds, split-K ranges, the 128-byte shared-memory swizzle, wgmma descriptors and accumulator
// fragments. Everything is __host__ __device__ so host tests (tests/kernels/tile_math_test.cpp)
// check what no GPU here can run, and the kernels and the op code share one definition.
#pragma once

#include <cstdint>

#include "metrale/numerics.h"  // METRALE_HD

namespace metrale::tiles {

// ---- decode (M <= 16): mma.sync m16n8k16, weights as the 16-row operand ----

inline constexpr int kDecodeThreads = 256;
inline constexpr int kDecodeWarps = kDecodeThreads / 32;
inline constexpr int kDecodeNTile = 32;    // output columns per block (two m16 row tiles)
inline constexpr int kDecodeKBlock = 128;  // K per warp step: one 16-byte code load per row
inline constexpr int kDecodeMaxM = 16;     // two n8 tiles of activations
// From this M the automatic route on CUDA prefers dequantize → cuBLASLt BF16 to gemm_tiled
// (dequant_bf16_min_m): modelled, not yet measured. See Note [route crossovers] in docs/NOTES.md.
inline constexpr int kDequantMinM = 256;
// K per split-K unit: one K block for every warp of the block.
inline constexpr int kDecodeSplitUnit = kDecodeKBlock * kDecodeWarps;

// Within a K block, lane (g = lane / 4, t = lane % 4) loads the 32 codes [32 t, 32 t + 32) of
// its rows, and MMA step s (0..7) takes 4 of them: j = 0..3 is physical k 32 t + 4 s + j. The
// MMA sums over its 16 k in any order, so the activations need only the same permutation.
METRALE_HD int decode_physical_k(int t, int s, int j) {
  return 32 * t + 4 * s + j;
}

// The MMA's own k index (0..15) of lane t's element j: the A fragment holds k = 2t, 2t + 1 in
// its first register pair and 2t + 8, 2t + 9 in its second (PTX ISA, m16n8k16 fragments).
METRALE_HD int decode_logical_k(int t, int j) {
  return j < 2 ? 2 * t + j : 2 * t + 8 + (j - 2);
}

// Where lane t's element j of MMA step s sits in what the lane loaded: byte 2s + j/2 of its 16
// bytes of codes (low nibble for even j), 32-bit word 2s + j/2 of its 64 bytes of BF16
// activations (low half for even j), and scale group s / 4 of its two.
METRALE_HD int decode_code_byte(int s, int j) {
  return decode_physical_k(0, s, j) / 2;
}
METRALE_HD int decode_act_word(int s, int j) {
  return decode_physical_k(0, s, j) / 2;
}
METRALE_HD int decode_group(int s) {
  return decode_physical_k(0, s, 0) / 16;
}

// ---- split-K ----

// How K is cut into grid z slices: `splits` slices of `k_per_split` elements (the last may be
// shorter; none is empty).
struct SplitK {
  std::int64_t splits = 1;
  std::int64_t k_per_split = 0;
};

// The split of K (in units of `unit` elements) that brings `blocks` (the grid without split)
// to at least `target` blocks, with at most `max_splits` slices and no empty slice. One slice is
// all of K (k_per_split = k, whatever the unit), the plan the GEMM ops check a run against.
METRALE_HD SplitK plan_split_k(std::int64_t k, std::int64_t unit, std::int64_t blocks,
                               std::int64_t target, std::int64_t max_splits) {
  const std::int64_t units = (k + unit - 1) / unit;
  std::int64_t want = blocks >= target ? 1 : (target + blocks - 1) / blocks;
  if (want > max_splits) want = max_splits;
  if (want > units) want = units;
  if (want < 1) want = 1;
  const std::int64_t per_units = (units + want - 1) / want;
  SplitK s;
  s.k_per_split = per_units * unit;
  s.splits = (units + per_units - 1) / per_units;  // drops slices that would start past K
  if (s.splits == 1) s.k_per_split = k;
  return s;
}

// The share of `slots` (the blocks all SMs hold at once) that `blocks` keep busy over the waves
// they take: blocks / (ceil(blocks / slots) x slots); 1 when the last wave is full.
METRALE_HD double wave_efficiency(std::int64_t blocks, std::int64_t slots) {
  if (blocks < 1 || slots < 1) return 0.0;
  const std::int64_t waves = (blocks + slots - 1) / slots;
  return static_cast<double>(blocks) / (static_cast<double>(waves) * static_cast<double>(slots));
}

// A split has to buy at least this much wave efficiency (as a fraction of what fewer splits
// reach): each slice adds an M x N FP32 plane written and read back by the reduction. Llama-3 70B
// gate/up on 132 SMs (1792 blocks) fills its waves 97.0% unsplit and 99.6% in 8 slices, but at
// M = 16 those planes would move 25% more bytes than the weights for 2.7%. Below 1/15, so that
// under one wave every further slice the cap allows (16 / 15 more blocks at worst) is taken.
inline constexpr double kSplitMinGain = 1.0 / 20;

// The split of K by waves: among the splits plan_split_k makes (whole units, no empty slice, at
// most max_splits), the one whose grid (blocks x splits) fills its waves of `slots` best, by
// wave_efficiency; a split that gains less than kSplitMinGain over fewer splits is not taken.
// Splitting only to reach `slots` blocks leaves a tail: 320 blocks on 132 slots run 3 waves,
// the last 42% full (81% overall); 2 slices make 640 blocks, 5 waves at 97%.
METRALE_HD SplitK plan_split_k_waves(std::int64_t k, std::int64_t unit, std::int64_t blocks,
                                     std::int64_t slots, std::int64_t max_splits) {
  SplitK best = plan_split_k(k, unit, blocks, blocks, max_splits);  // target met: no split
  if (blocks < 1 || slots < 1) return best;
  double best_efficiency = wave_efficiency(blocks, slots);
  for (std::int64_t want = 2; want <= max_splits; ++want) {
    // plan_split_k asks for `want` slices of a grid that wants blocks x want.
    const SplitK s = plan_split_k(k, unit, blocks, blocks * want, max_splits);
    const double e = wave_efficiency(blocks * s.splits, slots);
    if (s.splits > best.splits && e > best_efficiency * (1.0 + kSplitMinGain)) {
      best = s;
      best_efficiency = e;
    }
  }
  return best;
}

// [begin, end) of K for slice z.
METRALE_HD void split_k_range(std::int64_t k, std::int64_t k_per_split, std::int64_t z,
                              std::int64_t* begin, std::int64_t* end) {
  const std::int64_t b = z * k_per_split;
  const std::int64_t e = b + k_per_split;
  *begin = b < k ? b : k;
  *end = e < k ? e : k;
}

// ---- prefill (wgmma, sm_90a): 128x256 block tiles of BF16, 64 K per stage, 4 stages ----

inline constexpr int kTiledThreads = 256;  // two warpgroups, 64 rows of M each
inline constexpr int kTiledMTile = 128;
inline constexpr int kTiledNTile = 256;  // m64n256 per warpgroup
// Runs of 32 codes (half a stage row of W) each thread loads and dequantizes per stage.
inline constexpr int kTiledBRunsPerThread = kTiledNTile * 2 / kTiledThreads;
inline constexpr int kTiledKStage = 64;  // BF16: one 128-byte swizzled row per M or N
// Four buffers: stage k is multiplied while k - 1's MMAs may still run, k + 1's weights are
// stored and k + 2's loads are in flight.
inline constexpr int kTiledStages = 4;
inline constexpr int kTiledPrefetch = 2;  // stages loaded ahead of the one multiplied
inline constexpr int kTiledStageBytes = (kTiledMTile + kTiledNTile) * kTiledKStage * 2;
// Dynamic shared memory: the stages, plus slack to align the base to the 1024-byte swizzle atom.
inline constexpr int kTiledSmemBytes = kTiledStages * kTiledStageBytes + 1024;

// ---- E4M3 (wgmma FP8, sm_90a): 128x64 tiles, one scale group (16 K) per MMA ----

inline constexpr int kE4m3Threads = 256;
inline constexpr int kE4m3MTile = 128;
inline constexpr int kE4m3NTile = 64;
inline constexpr int kE4m3Group = 16;  // K per FP32 scale step (the NVFP4 block)
// A stage holds 4 groups; each group's 16 bytes sit in a 32-byte slot whose upper half stays
// zero, so the k32 MMA sums exactly one group (E4M3 cannot hold the scaled weights exactly).
inline constexpr int kE4m3GroupsPerStage = 4;
inline constexpr int kE4m3RowBytes = 128;
inline constexpr int kE4m3Stages = 3;
inline constexpr int kE4m3StageBytes =
    (kE4m3MTile + kE4m3NTile) * kE4m3RowBytes + kE4m3NTile * kE4m3GroupsPerStage * 4;
inline constexpr int kE4m3SmemBytes = kE4m3Stages * kE4m3StageBytes + 1024;

// ---- shared memory layout of wgmma operands ----

// Byte offset of byte `col_byte` of row `row` in a K-major tile of 128-byte rows with the
// 128-byte swizzle (the 16-byte chunk index XORed with row % 8), tile base 1024-byte aligned.
METRALE_HD std::uint32_t swizzle128(std::uint32_t row, std::uint32_t col_byte) {
  const std::uint32_t chunk = (col_byte >> 4) ^ (row & 7u);
  return row * 128u + (chunk << 4) + (col_byte & 15u);
}

// The 64-bit wgmma shared-memory matrix descriptor of a K-major, 128-byte-swizzled tile starting
// at shared address `addr`: start address >> 4 in bits 0-13, leading offset (unused when
// swizzled; 1 by convention) in 16-29, stride between 8-row groups (1024 bytes) >> 4 in 32-45,
// base offset 0 (the atoms are 1024-aligned), layout SWIZZLE_128B (1) in bits 62-63.
METRALE_HD std::uint64_t wgmma_desc_sw128(std::uint32_t addr) {
  std::uint64_t d = 0;
  d |= static_cast<std::uint64_t>((addr >> 4) & 0x3FFFu);
  d |= static_cast<std::uint64_t>(1u) << 16;
  d |= static_cast<std::uint64_t>(1024u >> 4) << 32;
  d |= static_cast<std::uint64_t>(1u) << 62;
  return d;
}

// Row (0..63) and column of accumulator register i of thread `tid` (0..127) of a warpgroup for
// wgmma m64nN: warp w owns rows 16w..16w+15; lane (g, t) rows g and g + 8, columns 8j + 2t and
// 8j + 2t + 1 for j = 0..N/8-1 (PTX ISA, wgmma D fragments).
METRALE_HD int wgmma_acc_row(int tid, int i) {
  const int warp = tid / 32, lane = tid % 32;
  return 16 * warp + lane / 4 + 8 * ((i >> 1) & 1);
}
METRALE_HD int wgmma_acc_col(int tid, int i) {
  const int lane = tid % 32;
  return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1);
}

// ---- m16n8k16 fragments (decode) ----

// Row (n, 0..15) and column (m, 0..7) of accumulator register i (0..3) of lane `lane` in the
// m16n8 D fragment: rows g and g + 8, columns 2t and 2t + 1.
METRALE_HD int mma_acc_row(int lane, int i) {
  return lane / 4 + 8 * (i >> 1);
}
METRALE_HD int mma_acc_col(int lane, int i) {
  return 2 * (lane % 4) + (i & 1);
}

}  // namespace metrale::tiles
