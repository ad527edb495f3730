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
#include "kernels/int4_decode_layout.h"
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

// Registers per thread: the launch gives each of the kThreads threads kLaunchRegisters (65536 /
// 384, to ptxas's granule of 8); setmaxnreg then moves them to the producer, whose two sets of
// activations (128 registers) do not fit in 168, from the consumers. The SM's 65536 registers
// hold the block only if the moved registers balance.
inline constexpr int kLaunchRegisters = 168;
inline constexpr int kProducerRegisters = 184;
inline constexpr int kConsumerRegisters = 160;
static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <=
                  kThreads * kLaunchRegisters,
              "the registers the roles take fit the ones the block was launched with");

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

// The block's shared memory, all of it dynamic (so that the host emulation lays out the same
// bytes): the stages, each consumer warpgroup's epilogue staging (its 64 rows x kTokens tokens
// in BF16, or half the tokens at a time in FP32), the scale table, and the mbarriers: full and
// empty per stage, and one turn barrier per consumer warpgroup (Note [fused ping-pong]).
inline constexpr int kEpilogueBytes = kRowsPerConsumer * kTokens * 2;
inline constexpr int kEpilogueOffset = kStages * kStageBytes;
inline constexpr int kTableOffset = kEpilogueOffset + kConsumers * kEpilogueBytes;
inline constexpr int kBarrierOffset = kTableOffset + dl::kTableBytes;
inline constexpr int kFullBarrier = kBarrierOffset;
inline constexpr int kEmptyBarrier = kFullBarrier + 8 * kStages;
inline constexpr int kTurnBarrier = kEmptyBarrier + 8 * kStages;
inline constexpr int kLayoutBytes = kTurnBarrier + 8 * kConsumers;
// Dynamic shared memory to ask for: the layout and slack to start it on a 1024-byte boundary.
inline constexpr int kSmemBytes = kLayoutBytes + 1024;
static_assert(kSmemBytes <= 227 * 1024, "one block fits an sm_90 SM's 227 KiB");

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

// Byte, within a stage's codes, of the 16-byte chunk q (0..3) that thread wtid of warpgroup wg
// loads whole: steps 2q and 2q + 1 of both row tiles of its decode tile, its own row tile's
// words being word rt (step 2q) and word 2 + rt (step 2q + 1). The warp's 32 chunks are 512
// contiguous bytes, so each 8-lane phase of the 16-byte load covers all 32 banks once; loading
// only the warp's own 4-byte words would hit each bank 4 times (lanes 16 bytes apart).
METRALE_HD int fused_chunk_byte(int wg, int wtid, int q) {
  const int warp = wtid / 32, lane = wtid % 32;
  const int tile = 2 * wg + warp / 2;
  return tile * dl::kTileBlockBytes + q * (dl::kLanes * dl::kChunkBytes) + lane * dl::kChunkBytes;
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

// ---- INT4 weights (kernels/int4_decode_layout.h): gemm_grouped_int4_fused ----
//
// The INT4 decode layout keeps the FP4 layout's tile grid and word places, so the consumers load
// the same chunks and the B tile has the same shape; only the order of K inside a K block
// differs. Lane t's word of step s holds physical K 32 (s / 2) + 8 t + 4 (s % 2) + j (j as in
// fused_physical_k) where the FP4 layout's holds 32 t + 4 s + j.

// Physical K (0..127 in the K block) of MMA k `kk` (0..15) of step s in the INT4 layout.
METRALE_HD int fused_int4_physical_k(int s, int kk) {
  const int t = (kk % 8) / 2, j = 2 * (kk / 8) + kk % 2;
  return 32 * (s / 2) + 8 * t + 4 * (s % 2) + j;
}

// Physical K of the first of the 8 activations that producer unit u (0..3: its thread's place
// among a token's four) loads as source chunk t (0..3). FP4: 32 t + 8 u. INT4: 32 u + 8 t, so
// that source chunk t's word d (K 32 u + 8 t + 2 d) is step 2 u + d / 2, pair d % 2 of lane t:
// the destination fused_act_chunk_offset gives the FP4 unit's word d of chunk t. One transpose
// and one set of stores serve both layouts; only the loads' addresses differ.
METRALE_HD constexpr int fused_source_k(int u, int t, bool int4) {
  return int4 ? 32 * u + 8 * t : 32 * t + 8 * u;
}

// A decode tile's side bytes a stage holds for INT4 weights: one K block's scales and zero
// points (int4_decode::side_block_bytes), 96 bytes for groups of 128 and more, 384 for groups of
// 32 and 64; slots of the larger size, where the FP4 stage keeps its scale codes and the grouped
// stage its table.
inline constexpr int kInt4SideSlotBytes = 3 * 32 * 4;
static_assert(kInt4SideSlotBytes == int4_decode::side_block_bytes(4), "the larger side block");

// Where in its decode tile's side slot consumer thread wtid loads the scales of its two rows
// (g + 16 rt and g + 16 rt + 8 of the tile; upper 0 and 1) for `entries` entries a row
// (int4_decode::side_slot's [g][r][entry]): 4 bytes (one entry: upper 0's scale, then upper
// 1's) or 16 (four: upper 0's entries, then upper 1's).
METRALE_HD int fused_int4_scale_at(int wtid, int entries) {
  const int g = (wtid % 32) / 4, rt = (wtid / 32) % 2;
  return entries == 1 ? 8 * g + 4 * rt : 32 * g + 16 * rt;
}
// ... and their zero points: one entry, 4 bytes holding rt 0's two and rt 1's two (the thread's at
// byte 2 rt + upper); four, 8 bytes (upper 0's four, then upper 1's).
METRALE_HD int fused_int4_zero_at(int wtid, int entries) {
  const int g = (wtid % 32) / 4, rt = (wtid / 32) % 2;
  return entries == 1 ? 64 + 4 * g : 256 + 16 * g + 8 * rt;
}

// ---- the activations: the B tile in shared memory ----

// The 32-byte column (0..3) of its half's 128-byte rows that wgmma step s reads: s % 4 in the
// first half, (s % 4) ^ 1 in the second. Why the second half is permuted: a producer thread
// stores one 16-byte chunk per instruction, the same chunk d for all its lanes, and units 0 and
// 2 of a token (and 1 and 3) put chunk d in the two halves, 16 KiB apart; at the same column
// those two stores share banks (a 2-way conflict in every 8-lane phase). With the second half's
// steps swapped in pairs the four units of a token hit columns {d, 4 + d, d ^ 2, 4 + (d ^ 2)},
// and the phase's two tokens (swizzled by token % 8, one even, one odd) cover all 32 banks once.
// wgmma takes any 32-byte offset within the swizzled row, so the descriptor absorbs the
// permutation at no cost.
METRALE_HD int fused_step_column(int s) {
  return (s % 4) ^ (s / 4);
}

// Byte offset, within a stage's activations, of token `token`'s element at physical K `k`
// (0..127): step s = (k % 32) / 4 is wgmma step s, which reads 64-K half s / 4 at MMA column
// 16 fused_step_column(s) + kk, 128-byte swizzled (tiles::swizzle128).
METRALE_HD std::uint32_t fused_act_offset(int token, int k) {
  const int t = k / 32, s = (k % 32) / 4, j = k % 4;
  const int kk = 2 * t + 8 * (j / 2) + j % 2;
  const int col = 16 * fused_step_column(s) + kk;
  return static_cast<std::uint32_t>((s / 4) * kActHalfBytes) +
         tiles::swizzle128(static_cast<std::uint32_t>(token), static_cast<std::uint32_t>(2 * col));
}

// The producer's unit: token `token`, source chunks t = 0..3 (physical K fused_source_k(u, t)
// .. + 7, 16 bytes each: 32 t + 8 u, INT4 32 u + 8 t). Destination chunk d = 2 sh + p (step
// 2 u + sh, k pair p) gets word t from word d of source chunk t: a 4x4 transpose of 32-bit
// words, the same for both layouts. Its byte offset in the stage:
METRALE_HD std::uint32_t fused_act_chunk_offset(int token, int u, int d) {
  const int s = 2 * u + d / 2, p = d % 2;
  return static_cast<std::uint32_t>((s / 4) * kActHalfBytes) +
         tiles::swizzle128(static_cast<std::uint32_t>(token),
                           static_cast<std::uint32_t>(2 * (16 * fused_step_column(s) + 8 * p)));
}

// The descriptor wgmma step s reads the B tile with (stage activations at shared address
// `act`, 1024-aligned): K-major, 128-byte swizzle, 8-row groups 1024 bytes apart; step s
// starts at its half's column fused_step_column(s), 32 bytes (16 BF16) each.
METRALE_HD std::uint64_t fused_b_desc(std::uint32_t act, int s) {
  return tiles::wgmma_desc_sw128(act + static_cast<std::uint32_t>((s / 4) * kActHalfBytes) +
                                 32u * static_cast<std::uint32_t>(fused_step_column(s)));
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

// ---- the epilogue ----

// Byte, within a warpgroup's epilogue staging, of byte `col_byte` of token row `token`, the rows
// `row_bytes` long (128: 64 BF16; 256: 64 FP32), their 16-byte columns XOR-swizzled by token % 8
// as wgmma's 128-byte swizzle is. A warp's accumulator register i holds 4 tokens (lanes t) x 8
// rows (lanes g): unswizzled, the 4 tokens' rows start on the same bank and the stores conflict
// 4 ways; swizzled, they land in 4 different 16-byte columns.
METRALE_HD std::uint32_t fused_stage_offset(int token, int col_byte, int row_bytes) {
  const int column = (col_byte / 16) ^ (token % 8);
  return static_cast<std::uint32_t>(token * row_bytes + column * 16 + col_byte % 16);
}

// ---- the tile schedule (Note [fused tile order]) ----

// Tiles of the grid: M (tokens) in kTokens, N (weight rows) in kRows.
METRALE_HD std::int64_t fused_tiles(std::int64_t m, std::int64_t n) {
  return ((m + kTokens - 1) / kTokens) * ((n + kRows - 1) / kRows);
}

// The L2 bytes one band's activations may hold: half of an H200's 50 MiB, the rest left to the
// weights streaming through, C and the other SMs' traffic.
inline constexpr std::int64_t kBandBytes = std::int64_t{24} << 20;

// M tiles a band holds: as many as kBandBytes of activations (kTokens rows of K BF16 each), at
// least 1, at most all of them.
METRALE_HD std::int64_t fused_band(std::int64_t m_tiles, std::int64_t k) {
  const std::int64_t per_tile = std::int64_t{kTokens} * dl::padded_k(k) * 2;
  const std::int64_t band = kBandBytes / per_tile;
  return band < 1 ? 1 : (band > m_tiles ? m_tiles : band);
}

struct TileCoords {
  int m_tile = 0, n_tile = 0;
};

// Tile `tile` (0 .. fused_tiles - 1, which the op keeps below 2^31) in the band order: bands of
// `band` M tiles, one after another; within a band, M fastest, then N (the last band may hold
// fewer M tiles).
METRALE_HD TileCoords fused_tile_coords(int tile, int m_tiles, int n_tiles, int band) {
  const int per_band = band * n_tiles;
  const int b = tile / per_band, in = tile % per_band;
  const int left = m_tiles - b * band;
  const int rows = left < band ? left : band;
  return TileCoords{b * band + in % rows, in / rows};
}

// ---- gemm_grouped_fused: the same pipeline over the experts of a layer ----
//
// The grouped kernel's M axis is a list of slots: expert e's rows (kernels/grouped_params.h, read
// on the device) take ceil(rows / kTokens) consecutive slots, experts in order, so that the dense
// band order walks (slot, N tile) as it walks (M tile, N tile). Each block reads the counts and
// offsets once and keeps every expert's first slot in shared memory; a tile finds its expert by a
// binary search there. Experts differ in their scale tables (MXFP4 folds per expert), so each
// stage carries its expert's table, copied beside its codes; the stage grows by that 1 KiB.

// The most experts the grouped kernel takes (ops/grouped_gemm.cpp refuses more).
inline constexpr int kGroupedMaxExperts = 1024;
inline constexpr int kGroupedTableInStage = kStageBytes;
inline constexpr int kGroupedStageBytes = kStageBytes + dl::kTableBytes;
static_assert(kGroupedStageBytes % 1024 == 0, "stages start on the 1024-byte swizzle atom");
// gemm_grouped_int4_fused's stages are the grouped ones: its side slots take the place of the
// scale codes and the table.
static_assert(kScaleOffset + kTilesPerBlock * kInt4SideSlotBytes <= kGroupedStageBytes,
              "an INT4 stage's side slots fit the grouped stage");
inline constexpr int kGroupedEpilogueOffset = kStages * kGroupedStageBytes;
// Expert e's first slot at entry e (e = 0 .. experts; entry experts is the slots' count), and
// the second buffer of the scan that fills it.
inline constexpr int kGroupedFirstSlotOffset = kGroupedEpilogueOffset + kConsumers * kEpilogueBytes;
// Entries of each: 0 and every expert's, padded to a whole number a thread (kThreads), so that
// every thread makes the same accesses (Note [grouped fused tiles]).
inline constexpr int kGroupedScanEntries =
    (kGroupedMaxExperts + 1 + kThreads - 1) / kThreads * kThreads;
inline constexpr int kGroupedSlotBufferBytes = 4 * kGroupedScanEntries;
// A ring of the producer's tiles (16 bytes each: first row, first weight row, expert << 8 |
// rows), tile j of a block at entry j % kGroupedTileRing: the consumers read their tile's after
// its MMA loop rather than find it again (Note [grouped fused tiles]). The producer writes tile
// j + ring's when its walk reaches it, having claimed every stage up to two before that tile's
// first; the last of those claims waited for the release of a stage kStages earlier, of tile
// j + 1 or later (ring tiles of a stage at least, ring - 2 - kStages >= 1), and the consumers
// read tile j's before they release any stage of tile j + 1.
inline constexpr int kGroupedTileRing = 2 * kStages;
inline constexpr int kGroupedTileOffset = kGroupedFirstSlotOffset + 2 * kGroupedSlotBufferBytes;
inline constexpr int kGroupedBarrierOffset = kGroupedTileOffset + 16 * kGroupedTileRing;
inline constexpr int kGroupedLayoutBytes = kGroupedBarrierOffset + 16 * kStages + 8 * kConsumers;
inline constexpr int kGroupedSmemBytes = kGroupedLayoutBytes + 1024;
static_assert(kGroupedSmemBytes <= 227 * 1024, "one grouped block fits an sm_90 SM's 227 KiB");

// The experts the grouped kernel reads: the call's, at most kGroupedMaxExperts (the op refuses
// more; a launch of its own with more leaves the rest alone rather than overrun the scan).
METRALE_HD int grouped_experts(std::int64_t experts) {
  return experts < kGroupedMaxExperts ? static_cast<int>(experts) : kGroupedMaxExperts;
}

// The most slots a call of A's `capacity` rows over `experts` experts can make, where no row
// belongs to two experts: floor(capacity / kTokens) whole slots and a partial one per expert with
// rows. The op sizes its grid and the 32-bit tile count by it, and the kernel counts no more
// (experts whose rows a caller made overlap would otherwise count past it).
METRALE_HD std::int64_t grouped_max_slots(std::int64_t capacity, std::int64_t experts) {
  return capacity / kTokens + (experts < capacity ? experts : capacity);
}

// Slots of an expert with `rows` rows starting at row `first` of A's `capacity`: none where
// kernels/grouped_params.h's expert_params skips it (no rows, or rows outside [0, capacity)).
METRALE_HD int grouped_slots(std::int64_t rows, std::int64_t first, std::int64_t capacity) {
  if (rows <= 0 || first < 0 || first > capacity - rows) return 0;
  return static_cast<int>((rows + kTokens - 1) / kTokens);
}

// The expert whose slots hold `slot` (0 <= slot < first_slot(experts)), first_slot(e) being
// expert e's first slot: the last e with first_slot(e) <= slot, which skips experts without slots
// (their first slot is the next one's).
template <class FirstSlot>
METRALE_HD int grouped_expert_of(FirstSlot first_slot, int experts, int slot) {
  int lo = 0, hi = experts;  // first_slot(lo) <= slot < first_slot(hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first_slot(mid) <= slot) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace metrale::fused
