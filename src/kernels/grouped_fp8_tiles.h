// The tile math of gemm_grouped_e4m3_block128_tiled (cuda/kernels/grouped_e4m3_sm90.cuh), the
// grouped W8A8 GEMM's prefill kernel on Hopper's FP8 tensor cores: tiles of 128 of an expert's
// rows x 128 weight rows, one 128-K scale block a stage. Both operands are E4M3 bytes in shared
// memory (wgmma SS, K-major, 128-byte swizzle), loaded with cp.async; each stage's four k32 MMAs
// sum the block into a fresh FP32 tile, which is multiplied by the row's A scale times the
// tile's one W scale and added to the accumulator (Note [grouped FP8 tiles]). Everything here is
// __host__ __device__, so that the op, the host tests and the kernel share one definition.
#pragma once

#include <cstdint>

#include "kernels/fp8_cast.h"
#include "kernels/fused_tile.h"
#include "metrale/numerics.h"  // METRALE_HD

namespace metrale::grouped_fp8::tiled {

inline constexpr int kThreads = 256;       // two warpgroups, 64 of the tile's rows each
inline constexpr int kMTile = 128;         // an expert's rows a tile (C rows)
inline constexpr int kNTile = 128;         // weight rows a tile (C columns): wgmma m64n128k32
inline constexpr int kKStage = 128;        // K a stage: one scale block of A and of W
inline constexpr int kStages = 4;          // three stages in flight while one is multiplied
inline constexpr int kRowBytes = kKStage;  // one 128-byte swizzled row per operand row
inline constexpr int kABytes = kMTile * kRowBytes;
inline constexpr int kBBytes = kNTile * kRowBytes;
inline constexpr int kStageBytes = kABytes + kBBytes;
// 16-byte chunks each thread copies per stage, of A and of W.
inline constexpr int kAChunks = kABytes / 16 / kThreads;
inline constexpr int kBChunks = kBBytes / 16 / kThreads;

static_assert(kKStage == fp8::kCastBlock, "a stage is one scale block");
static_assert(kNTile == fp8::kCastBlock, "a tile's columns share one W scale a block");
static_assert(kStageBytes % 1024 == 0, "stages start on the 1024-byte swizzle atom");
static_assert(kAChunks * kThreads * 16 == kABytes && kBChunks * kThreads * 16 == kBBytes,
              "every thread copies whole chunks");
// An expert's rows are cut into slots of kMTile as gemm_grouped_fused cuts them (fused_tile.h's
// grouped_slots, grouped_max_slots and grouped_expert_of), so the kernel shares their rules.
static_assert(kMTile == fused::kTokens, "the slots of fused_tile.h are kMTile rows");

// The first-slot scan (cuda/kernels/grouped_slots.cuh): entry 0 and one per expert, padded to
// whole rounds of the block's threads, in two buffers after the stages.
inline constexpr int kScanEntries =
    (fused::kGroupedMaxExperts + 1 + kThreads - 1) / kThreads * kThreads;
inline constexpr int kSlotOffset = kStages * kStageBytes;
inline constexpr int kSlotBufferBytes = 4 * kScanEntries;
inline constexpr int kLayoutBytes = kSlotOffset + 2 * kSlotBufferBytes;
// Dynamic shared memory: the layout, plus slack to align the base to the 1024-byte atom.
inline constexpr int kSmemBytes = kLayoutBytes + 1024;
static_assert(kSmemBytes <= 227 * 1024, "one block fits an sm_90 SM's 227 KiB");

// The tiles of a call: every expert's slots (at most grouped_max_slots(rows, experts)) times
// the N tiles. Tile t is slot t / n_tiles, N tile t % n_tiles: a slot's N tiles are neighbours,
// so the blocks of a wave share its rows of A in L2.
METRALE_HD std::int64_t n_tiles(std::int64_t n) {
  return (n + kNTile - 1) / kNTile;
}

}  // namespace metrale::grouped_fp8::tiled
