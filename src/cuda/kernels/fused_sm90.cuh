// gemm_fused: the prefill GEMM on weights in the decode layout (kernels/decode_layout.h), sm_90a.
// C^T = W · A^T on wgmma with the weights as the A operand from registers (the RS form) and the
// activations as B from shared memory, warp-specialized and persistent (index math and its
// reasons: kernels/fused_tile.h; the schedule: Note [fused pipeline] in docs/NOTES.md):
// - the grid is at most one block per SM; block b runs tiles b, b + grid, ... in the band order
//   of fused_tile_coords, so a block's prologue and epilogue overlap its neighbours' work;
// - the producer warpgroup fills a ring of stages (one 128-K block each) across tile boundaries:
//   lane 0 of its warp q has the TMA unit copy decode tile q's packed codes and scale codes
//   (cp.async.bulk, complete_tx on the stage's full barrier), and all its threads load the
//   activations in
//   16-byte chunks one stage ahead into a second register set, so two stages of loads are in
//   flight while one is stored K-permuted into the 128-byte-swizzled tile (a 4x4 word transpose
//   in registers, fused_store_chunk's order keeping the stores conflict-free);
// - each consumer warpgroup (64 weight rows, all 128 tokens) loads its decode-layout chunks,
//   dequantizes them in registers with the decode kernel's own conversion (packed_fields, then
//   one BF16x2 multiply by the scale's table pair), and issues 8 wgmma m64n128k16 RS per block
//   in turn with the other warpgroup (two turn barriers: one dequantizes while the other's
//   HGMMAs run), then waits for its wgmmas and hands the stage back on the empty barrier;
// - the epilogue scales by 2^fold and the tensor scale, adds the bias, stages the warpgroup's
//   tile in shared memory (fused_stage_offset) and stores C [M, N] rows in 16-byte pieces (rows
//   past M and columns past N masked; element stores where N or C's alignment forbid 16 bytes).
// Every piece runs on the host (tests/kernels/emulation/fused_host_test.cpp) as the GPU would run
// it: the three warpgroups as fibers, the mbarriers, bulk copies landing in random order, and
// wgmma from the PTX ISA's fragment rules.
// The same template is gemm_grouped_fused (every expert's tiles in one wave, Note [grouped fused
// tiles]) and gemm_grouped_int4_fused (INT4 experts in the INT4 decode layout: its consumers
// dequantize with FusedInt4's pieces, its producer reads A in that layout's K order; Note [grouped
// fused INT4]; tests/kernels/emulation/fused_int4_host_test.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "decode_int4.cuh"
#include "decode_packed.cuh"
#include "epilogue.cuh"
#include "grouped_slots.cuh"
#include "kernels/decode_layout.h"
#include "kernels/fused_tile.h"
#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "kernels/int4_decode_layout.h"
#include "metrale/numerics.h"
#include "operands.cuh"
#include "ptx.cuh"

namespace metrale::kernels {

namespace fu = metrale::fused;

// ---- the per-thread pieces (host-emulated by tests/kernels/emulation/fused_host_test.cpp) ----

// The producer's 4x4 transpose of 32-bit words: destination chunk d holds word d of each source
// chunk t, in order t (fused_act_chunk_offset).
__device__ __forceinline__ void fused_transpose(const uint4 (&src)[4], uint4 (&dst)[4]) {
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    dst[d] =
        make_uint4(word_of(src[0], d), word_of(src[1], d), word_of(src[2], d), word_of(src[3], d));
  }
}

// A consumer lane's scale pairs for its two rows (j = 0: row g, 1: row g + 8 of its row tile
// rt) and the block's two 16-K groups h, from its scale codes (8 bytes NVFP4, the low 4 MXFP4)
// and the block's table at shared address `table`.
template <bool kMx>
__device__ __forceinline__ void fused_scale_pairs(uint2 codes, int rt, std::uint32_t table,
                                                  std::uint32_t (&sp)[2][2]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 2 * rt + j, byte = kMx ? r : 2 * r + h;
      const std::uint32_t word = byte < 4 ? codes.x : codes.y;
      sp[j][h] = ptx::ld_shared_lookup(table + 4u * ((word >> (8 * (byte % 4))) & 0xFFu));
    }
  }
}

// Step s's A fragment from its decode-layout word: the four field shapes of packed_fields, each
// times its row's scale pair of the step's group (the weights times 2^-fold, exact).
__device__ __forceinline__ void fused_a_fragment(std::uint32_t w, const std::uint32_t (&sp)[2][2],
                                                 int s, std::uint32_t (&a)[4]) {
  std::uint32_t f[4];
  packed_fields(w, f);
  const int h = s / 4;
  a[0] = num::bf16x2_mul(f[0], sp[0][h]);
  a[1] = num::bf16x2_mul(f[1], sp[1][h]);
  a[2] = num::bf16x2_mul(f[2], sp[0][h]);
  a[3] = num::bf16x2_mul(f[3], sp[1][h]);
}

// A fault the host emulation plants to show that its checks catch it
// (tests/kernels/emulation/fused_host_test.cpp); a constant false on the device.
#if defined(METRALE_KERNEL_HOST_EMULATION)
#define METRALE_FUSED_PLANTED(what) \
  (::metrale::emulation::planted(::metrale::emulation::Plant::what))
#else
#define METRALE_FUSED_PLANTED(what) false
#endif

// The weights a fused consumer reads: FP4 in the decode layout (MXFP4 where kMx, else NVFP4), or
// INT4 in the INT4 decode layout (Note [grouped fused INT4]) with kEntries scale entries per row
// and K block (int4_decode::entries: 1 or 4) and FP16 or BF16 scales.
template <bool kMx_>
struct FusedFp4 {
  static constexpr bool kInt4 = false, kMx = kMx_, kF16 = false;
  static constexpr int kEntries = 0;
};
template <int kEntries_, bool kF16_>
struct FusedInt4 {
  static constexpr bool kInt4 = true, kMx = false, kF16 = kF16_;
  static constexpr int kEntries = kEntries_;
};

// A consumer lane's INT4 side bytes of one K block, as loaded from its tile's side slot: kE = 1,
// sc.x holds the scales of its rows upper 0 and 1 (row g + 16 rt + 8 upper of the decode tile)
// and zz.x their zero points in bytes 0 and 1; kE = 4, sc holds upper 0's four entries' scales
// (x, y), then upper 1's (z, w), and zz.x upper 0's four zero points, zz.y upper 1's
// (int4_decode::side_slot: [g][r][entry]).
template <int kE>
__device__ __forceinline__ void fused_int4_side(std::uint32_t slot, int wtid, uint4& sc,
                                                uint2& zz) {
  const auto scale_at = slot + static_cast<std::uint32_t>(fu::fused_int4_scale_at(wtid, kE));
  const auto zero_at = slot + static_cast<std::uint32_t>(fu::fused_int4_zero_at(wtid, kE));
  if constexpr (kE == 1) {
    sc.x = ptx::ld_shared4(scale_at);
    zz.x = ptx::ld_shared4(zero_at) >> (16u * static_cast<std::uint32_t>((wtid / 32) % 2));
  } else {
    static_assert(kE == 4, "one entry per K block or per 32-K span");
    sc = ptx::ld_shared16(scale_at);
    zz = ptx::ld_shared8(zero_at);
  }
}

// The BF16 pair (h, h) of half `half` of w: on the device a half-select that ptxas folds into
// the multiply reading it (an R.H0_H0 or R.H1_H1 operand), no instruction of its own.
__device__ __forceinline__ std::uint32_t fused_half_pair(std::uint32_t w, int half) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat162 v;
  std::memcpy(&v, &w, 4);
  const __nv_bfloat162 r = half != 0 ? __high2bfloat162(v) : __low2bfloat162(v);
  std::uint32_t out;
  std::memcpy(&out, &r, 4);
  return out;
#else
  const std::uint32_t h = (w >> (16 * half)) & 0xFFFFu;
  return h | h << 16;
#endif
}

// An FP16 pair, exact as two BF16 pairs: hi its top 8 significant bits (the 3 low bits of each
// significand cleared, truncating), lo the rest (at most 3 bits), so that x hi + x lo is x times
// the scale and one BF16 FMA of x hi onto x lo rounds that once (fused_int4_fragment).
__device__ __forceinline__ void fused_f16_split(std::uint32_t w, std::uint32_t& hi,
                                                std::uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  __half2 wh;
  std::memcpy(&wh, &w, 4);
  const float2 f = __half22float2(wh);
#else
  const float2 f{num::f16_to_f32(static_cast<std::uint16_t>(w)),
                 num::f16_to_f32(static_cast<std::uint16_t>(w >> 16))};
#endif
  // The top 8 significant bits: the FP32 value's top 16 bits. A planted fault rounds the scale to
  // BF16 instead and drops the rest (two roundings of the product).
  const bool rounded = METRALE_FUSED_PLANTED(kInt4ScaleRounded);
  const auto top = [rounded](float v) {
    return rounded ? num::bf16_to_f32(num::f32_to_bf16(v))
                   : num::bits_f32(num::f32_bits(v) & 0xFFFF0000u);
  };
  const float t0 = top(f.x), t1 = top(f.y);
  // Both parts have their bits in the FP32 values' top halves: BF16 as they stand (one PRMT each).
  hi = ptx::prmt2<0x7632u>(num::f32_bits(t0), num::f32_bits(t1));
  lo = rounded ? 0u : ptx::prmt2<0x7632u>(num::f32_bits(f.x - t0), num::f32_bits(f.y - t1));
}

// A consumer lane's INT4 scales of one K block as BF16 (kWords words of two: kE = 1, rows upper
// 0 and 1; kE = 4, word 2 u + e / 2 holds row upper u's entries e, e + 1), and for FP16 scales
// the low parts beside them (fused_f16_split).
template <class W>
struct FusedInt4Scales {
  static constexpr int kWords = W::kEntries == 1 ? 1 : 4;
  std::uint32_t hi[kWords], lo[kWords];
};

template <class W>
__device__ __forceinline__ FusedInt4Scales<W> fused_int4_scales(const uint4& sc) {
  FusedInt4Scales<W> s;
  const std::uint32_t words[4] = {sc.x, sc.y, sc.z, sc.w};
#pragma unroll
  for (int i = 0; i < FusedInt4Scales<W>::kWords; ++i) {
    if constexpr (W::kF16) {
      fused_f16_split(words[i], s.hi[i], s.lo[i]);
    } else {
      s.hi[i] = words[i];
      s.lo[i] = 0;
    }
  }
  return s;
}

// The pairs that chunk q's words are dequantized with, for rows upper 0 and 1: zp (128 + z,
// twice), sp (the scale, or an FP16 scale's top bits, twice) and lo (an FP16 scale's low bits).
template <class W>
__device__ __forceinline__ void fused_int4_pairs(const FusedInt4Scales<W>& sc, const uint2& zz,
                                                 int q, std::uint32_t (&zp)[2],
                                                 std::uint32_t (&sp)[2], std::uint32_t (&lo)[2]) {
  const bool planted_entry = METRALE_FUSED_PLANTED(kInt4FirstEntry);
  const int e = W::kEntries == 1 || planted_entry ? 0 : q;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int word = W::kEntries == 1 ? 0 : 2 * u + e / 2;
    const int half = W::kEntries == 1 ? u : e % 2;
    // 128 + z twice: bytes z, 0x43, z, 0x43.
    const int b = W::kEntries == 1 ? u : e;
    zp[u] = ptx::prmt<0x43u>(W::kEntries == 1 || u == 0 ? zz.x : zz.y,
                             static_cast<std::uint32_t>(b | 4 << 4 | b << 8 | 4 << 12));
    sp[u] = fused_half_pair(sc.hi[word], half);
    lo[u] = W::kF16 ? fused_half_pair(sc.lo[word], half) : 0u;
  }
}

// Step s's A fragment from its INT4-layout word: register j (nibbles j and j + 4, row upper
// j % 2) as 128 + q by exponent bias, minus 128 + z (exact), times the scale, rounded once: the
// dequant route's bf16((q - z) x scale) (kernels/dequant_int4.h).
template <class W>
__device__ __forceinline__ void fused_int4_fragment(std::uint32_t w, const std::uint32_t (&zp)[2],
                                                    const std::uint32_t (&sp)[2],
                                                    const std::uint32_t (&lo)[2],
                                                    std::uint32_t (&a)[4]) {
  const std::uint32_t f[4] = {int4_fields<0>(w), int4_fields<4>(w), int4_fields<8>(w),
                              int4_fields<12>(w)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const std::uint32_t x = num::bf16x2_sub(f[j], zp[j % 2]);
    if constexpr (W::kF16) {
      a[j] = num::bf16x2_fma(x, sp[j % 2], num::bf16x2_mul(x, lo[j % 2]));
    } else {
      a[j] = num::bf16x2_mul(x, sp[j % 2]);
    }
  }
}

#if defined(METRALE_HAVE_WGMMA)

// gemm_fused's argument block or gemm_grouped_fused's (kernels/grouped_params.h): the fields
// every tile shares, and whether tiles belong to experts. One template serves both, so that the
// grouped kernel is the dense one's pipeline; where they differ (the tile walk, each tile's
// weights, table, rows, bias and scales) `if constexpr` keeps the dense code as it was.
__device__ __forceinline__ const GemmParams& gemm_of(const GemmParams& p) {
  return p;
}
__device__ __forceinline__ const GemmParams& gemm_of(const GroupedGemmParams& g) {
  return g.gemm;
}
template <class P>
inline constexpr bool kGrouped = std::is_same_v<P, GroupedGemmParams>;

// The block's shared memory (fused_tile.h's layout from the 1024-aligned shared address base);
// kG: the grouped layout, whose stages carry their expert's scale table.
template <bool kG>
struct FusedSmem {
  static constexpr int kStride = kG ? fu::kGroupedStageBytes : fu::kStageBytes;
  static constexpr int kFull = kG ? fu::kGroupedBarrierOffset : fu::kFullBarrier;
  static constexpr int kStaging = kG ? fu::kGroupedEpilogueOffset : fu::kEpilogueOffset;
  std::uint32_t base = 0;

  __device__ std::uint32_t stage(int s) const {
    return base + static_cast<std::uint32_t>(s) * kStride;
  }
  __device__ std::uint32_t full(int s) const { return base + kFull + 8u * s; }
  __device__ std::uint32_t empty(int s) const { return base + kFull + 8 * fu::kStages + 8u * s; }
  __device__ std::uint32_t turn(int wg) const { return base + kFull + 16 * fu::kStages + 8u * wg; }
  // The dense kernel's one scale table (the grouped kernel's are in the stages).
  __device__ std::uint32_t table() const { return base + fu::kTableOffset; }
  __device__ std::uint32_t staging(int wg) const {
    return base + kStaging + static_cast<std::uint32_t>(wg) * fu::kEpilogueBytes;
  }
  // The grouped kernel's first slot of each expert (fused_first_slots), and its ring of tiles.
  __device__ std::uint32_t first_slots() const { return base + fu::kGroupedFirstSlotOffset; }
  __device__ std::uint32_t tile_info(int j) const {
    const int ring = METRALE_FUSED_PLANTED(kSmallTileRing) ? 2 : fu::kGroupedTileRing;
    return base + fu::kGroupedTileOffset + 16u * static_cast<std::uint32_t>(j % ring);
  }
};

// Which output tile is which, for every role of the block alike. 32-bit counts (the op launches
// no more than 2^31 - 1 tiles) keep the registers that live across the MMA loop few. The grouped
// kernel's M tiles are its slots (fused_tile.h).
struct FusedWalk {
  int m_tiles = 0, n_tiles = 0, tiles = 0, band = 1, kb_count = 0, first = 0, stride = 1;
};

template <class P>
__device__ __forceinline__ FusedWalk fused_walk(const P& params, const FusedSmem<kGrouped<P>>& sm) {
  const GemmParams& p = gemm_of(params);
  FusedWalk w;
  if constexpr (kGrouped<P>) {
    const auto experts = static_cast<std::uint32_t>(fu::grouped_experts(params.experts));
    w.m_tiles = static_cast<int>(ptx::ld_shared_lookup(sm.first_slots() + 4u * experts));
  } else {
    (void)sm;
    w.m_tiles = static_cast<int>(METRALE_FUSED_PLANTED(kDropPartialTile)
                                     ? p.m / fu::kTokens
                                     : (p.m + fu::kTokens - 1) / fu::kTokens);
  }
  w.n_tiles = static_cast<int>((p.n + fu::kRows - 1) / fu::kRows);
  w.tiles = w.m_tiles * w.n_tiles;
  w.band = static_cast<int>(fu::fused_band(w.m_tiles, p.k));
  w.kb_count = static_cast<int>(dl::k_blocks(p.k));
  w.first = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
  w.stride = static_cast<int>(gridDim.x * gridDim.y);
  return w;
}

// One output tile: its first token (a row of A and C) and weight row, and how many decode tiles
// of it exist. The grouped kernel's tile also has an expert and its rows of the tile (1 ..
// kTokens), packed as expert << 8 | rows: one register more than the dense kernel's across the
// consumers' MMA loop (two, or a 64-bit end of rows, made ptxas spill the epilogue's offsets).
struct FusedTile {
  int m0 = 0, n0 = 0, dtiles = 0;
  int expert_rows = 0;
  __device__ int expert() const { return expert_rows >> 8; }
  __device__ int rows() const { return expert_rows & 0xFF; }
};

template <class P>
__device__ __forceinline__ FusedTile fused_tile_of(const P& params,
                                                   const FusedSmem<kGrouped<P>>& sm,
                                                   const FusedWalk& w, int tile) {
  const GemmParams& p = gemm_of(params);
  const fu::TileCoords c = fu::fused_tile_coords(tile, w.m_tiles, w.n_tiles, w.band);
  FusedTile t;
  if constexpr (kGrouped<P>) {
    // The slot's expert, and the slot's place among the expert's rows.
    const std::uint32_t first = sm.first_slots();
    const int e = fu::grouped_expert_of(
        [first](int i) {
          return static_cast<int>(
              ptx::ld_shared_lookup(first + 4u * static_cast<std::uint32_t>(i)));
        },
        fu::grouped_experts(params.experts), c.m_tile);
    const int slot0 =
        static_cast<int>(ptx::ld_shared_lookup(first + 4u * static_cast<std::uint32_t>(e)));
    const int row0 = __ldg(reinterpret_cast<const std::int32_t*>(params.offsets) + e);
    const int skip = (c.m_tile - slot0) * fu::kTokens;
    const int left = __ldg(reinterpret_cast<const std::int32_t*>(params.counts) + e) - skip;
    t.m0 = row0 + skip;
    t.expert_rows = e << 8 | (left < fu::kTokens ? left : fu::kTokens);
  } else {
    (void)sm;
    t.m0 = c.m_tile * fu::kTokens;
  }
  t.n0 = c.n_tile * fu::kRows;
  const std::int64_t left = dl::padded_n(p.n) / dl::kTileN - std::int64_t{t.n0} / dl::kTileN;
  t.dtiles = left < fu::kTilesPerBlock ? static_cast<int>(left) : fu::kTilesPerBlock;
  return t;
}

// A position in the block's sequence of stages: tile, its coordinates, K block.
struct FusedCursor {
  int tile = 0, kb = 0;
  FusedTile at;
};

// The stage after c in the block's sequence; false past its last.
template <class P>
__device__ __forceinline__ bool fused_next(const P& params, const FusedSmem<kGrouped<P>>& sm,
                                           const FusedWalk& w, FusedCursor& c) {
  if (++c.kb < w.kb_count) return true;
  c.kb = 0;
  c.tile += w.stride;
  if (c.tile >= w.tiles) return false;
  c.at = fused_tile_of(params, sm, w, c.tile);
  return true;
}

// The grouped kernel's first slot of each expert into shared memory (FusedSmem::first_slots;
// entry `experts` is the slots' count), by grouped_slots.cuh's scan. Ends with __syncthreads.
__device__ __forceinline__ void fused_first_slots(const GroupedGemmParams& g,
                                                  const FusedSmem<true>& sm) {
  grouped_first_slots<fu::kThreads, fu::kGroupedScanEntries>(
      reinterpret_cast<const std::int32_t*>(g.counts),
      reinterpret_cast<const std::int32_t*>(g.offsets), g.experts, g.gemm.m, sm.first_slots());
}

// The producer's units: unit c = wtid + 128 i is token c / 4, K chunk column u = c % 4, so four
// neighbouring threads read a token's 64 contiguous bytes of each 32-K group (INT4: a thread its
// 64 contiguous bytes of a 32-K group, four neighbours 256; fused_source_k).
constexpr int kFusedUnits = fu::kTokens * 4 / 128;

// One stage of activations into registers: 16 bytes of each unit's four source chunks, zero
// past the tile's rows and K. A thread's units are 32 tokens apart and its chunks 32 K apart
// (INT4: 8), so one row pointer a unit serves its four loads with immediate offsets; a tile
// wholly inside its rows and K (all but the last of each) takes the branch without bounds
// checks, the same for the whole block.
template <bool kInt4, class P>
__device__ __forceinline__ void fused_load_act(const P& params, const FusedCursor& c, int wtid,
                                               uint4 (&r)[kFusedUnits][4]) {
  const GemmParams& p = gemm_of(params);
  // fu::fused_source_k's two terms: the unit's (u) and its chunks' (t).
  constexpr int kUnitK = kInt4 ? 32 : 8, kChunkK = kInt4 ? 8 : 32;
  static_assert(fu::fused_source_k(1, 0, kInt4) == kUnitK &&
                fu::fused_source_k(0, 1, kInt4) == kChunkK);
  const int u = wtid % 4;
  const std::int64_t k0 = std::int64_t{c.kb} * fu::kKBlock, m = std::int64_t{c.at.m0} + wtid / 4;
  const auto* row = reinterpret_cast<const std::uint16_t*>(p.a) + m * p.k + k0 + kUnitK * u;
  const std::int64_t unit_step = 32 * p.k;  // 32 tokens further
  // The grouped tile's rows end at its expert's (FusedTile::rows).
  if ((kGrouped<P> ? c.at.rows() == fu::kTokens : c.at.m0 + fu::kTokens <= p.m) &&
      k0 + fu::kKBlock <= p.k) {
#pragma unroll
    for (int i = 0; i < kFusedUnits; ++i) {
#pragma unroll
      for (int t = 0; t < 4; ++t) r[i][t] = ptx::ldg16(row + i * unit_step + kChunkK * t);
    }
    return;
  }
  // K is a multiple of 16: a chunk of 8 lies wholly inside or outside.
  const std::int64_t m_left = kGrouped<P> ? c.at.rows() - wtid / 4 : p.m - m,
                     k_left = p.k - k0 - kUnitK * u;
#pragma unroll
  for (int i = 0; i < kFusedUnits; ++i) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      r[i][t] = 32 * i < m_left && kChunkK * t < k_left
                    ? ptx::ldg16(row + i * unit_step + kChunkK * t)
                    : make_uint4(0, 0, 0, 0);
    }
  }
}

// The producer warpgroup: every stage of every tile of this block, in the consumers' order. The
// activations of the next stage are loaded into the second register set before this stage's
// are stored, so two stages of loads are in flight (Note [fused pipeline]). INT4 weights
// (kInt4): each decode tile's side block of the K block, in place of its scale codes, and no
// table.
template <bool kInt4, bool kMx, class P>
__device__ void fused_produce(const P& params, const FusedSmem<kGrouped<P>>& sm, int wtid) {
  const GemmParams& p = gemm_of(params);
  const FusedWalk w = fused_walk(params, sm);
  // A decode tile's scale bytes of a K block, and the stage slot they go to.
  const int side = kInt4 ? static_cast<int>(i4::side_block_bytes(i4::entries(p.group)))
                         : dl::kLanes * dl::scale_bytes_per_lane(kMx);
  const int slot = kInt4 ? fu::kInt4SideSlotBytes : fu::kScaleSlotBytes;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes);
  const auto* scales =
      reinterpret_cast<const std::uint8_t*>(p.scales) + (kInt4 ? 0 : dl::kTableBytes);
  int stage = 0;
  std::uint32_t phase = 0;
  // A stage's first half: the consumers released it (at first: the phase before the first,
  // complete), and lane 0 of warp q has the TMA unit copy decode tile q's codes and scale codes,
  // announcing their bytes first: each announcement precedes its own copies and its thread's
  // arrival, so the transaction count never goes below 0 and the phase cannot complete before
  // every byte has landed. One tile a warp spreads the copies' issue over the four schedulers.
  // Issued before the next stage's loads, so that the copies' address math does not add to the
  // two register sets. The grouped kernel's tiles read their expert's weights, and warp 0 also
  // copies the expert's scale table into the stage.
  const auto claim = [&](const FusedCursor& c) {
    ptx::mbarrier_wait(sm.empty(stage), phase ^ 1u);
    const int q = wtid / 32;
    if (wtid % 32 != 0 || q >= c.at.dtiles) return;
    const std::uint32_t at = sm.stage(stage), full = sm.full(stage);
    auto bytes = static_cast<std::uint32_t>(dl::kTileBlockBytes + side);
    const std::uint8_t *tile_codes = codes, *tile_scales = scales;
    if constexpr (kGrouped<P>) {
      const auto e = static_cast<std::uint64_t>(c.at.expert());
      const std::uint64_t table_e = METRALE_FUSED_PLANTED(kExpertZeroTable) ? 0 : e;
      tile_codes += e * params.codes_stride;
      tile_scales += (kInt4 ? table_e : e) * params.scales_stride;
      if (!kInt4 && q == 0) bytes += dl::kTableBytes;
      if (!METRALE_FUSED_PLANTED(kSkipExpectTx)) ptx::mbarrier_expect_tx(full, bytes);
      if (!kInt4 && q == 0) {
        ptx::bulk_copy_g2s(
            at + fu::kGroupedTableInStage,
            reinterpret_cast<const std::uint8_t*>(p.scales) + table_e * params.scales_stride,
            dl::kTableBytes, full);
      }
    } else {
      if (!METRALE_FUSED_PLANTED(kSkipExpectTx)) ptx::mbarrier_expect_tx(full, bytes);
    }
    const std::int64_t block = (std::int64_t{c.at.n0} / dl::kTileN + q) * w.kb_count + c.kb;
    ptx::bulk_copy_g2s(at + fu::kCodeOffset + q * dl::kTileBlockBytes,
                       tile_codes + block * dl::kTileBlockBytes, dl::kTileBlockBytes, full);
    ptx::bulk_copy_g2s(at + fu::kScaleOffset + q * slot, tile_scales + block * side,
                       static_cast<std::uint32_t>(side), full);
  };
  // Its second half: the activations stored, published to wgmma's proxy and to the consumers.
  // Unit i's chunk d lies 32 i token rows (4 KiB) past unit 0's: four offsets a thread.
  std::uint32_t chunk_at[4];
#pragma unroll
  for (int d = 0; d < 4; ++d) {
    chunk_at[d] = fu::fused_act_chunk_offset(wtid / 4, wtid % 4, d);
    if (METRALE_FUSED_PLANTED(kWrongSwizzle)) {
      chunk_at[d] ^= static_cast<std::uint32_t>((wtid / 4) & 7) << 4;
    }
  }
  const auto fill = [&](const uint4(&r)[kFusedUnits][4]) {
    const std::uint32_t at = sm.stage(stage);
#pragma unroll
    for (int i = 0; i < kFusedUnits; ++i) {
      uint4 dst[4];
      fused_transpose(r[i], dst);
#pragma unroll
      for (int d = 0; d < 4; ++d) {
        ptx::st_shared16(at + chunk_at[d] + static_cast<std::uint32_t>(i * 32 * 128), dst[d]);
      }
    }
    ptx::fence_proxy_async();  // the stores, to wgmma's async proxy
    ptx::mbarrier_arrive(sm.full(stage));
    if (++stage == fu::kStages) {
      stage = 0;
      phase ^= 1u;
    }
  };
  // The grouped kernel's tile for the consumers' epilogue (Note [grouped fused tiles]), stored
  // when the walk reaches the tile, off the steady path: warp 0's lanes all store the same 16
  // bytes (one lane alone would make its shared accesses differ from its warp's).
  const auto publish = [&](const FusedCursor& c) {
    if constexpr (kGrouped<P>) {
      if (wtid / 32 == 0) {
        ptx::st_shared16(
            sm.tile_info(c.tile / w.stride),
            make_uint4(static_cast<std::uint32_t>(c.at.m0), static_cast<std::uint32_t>(c.at.n0),
                       static_cast<std::uint32_t>(c.at.expert_rows), 0u));
      }
    } else {
      (void)c;
    }
  };
  FusedCursor cur;
  cur.tile = w.first;
  if (cur.tile >= w.tiles) return;
  cur.at = fused_tile_of(params, sm, w, cur.tile);
  publish(cur);
  uint4 ra[kFusedUnits][4], rb[kFusedUnits][4];
  fused_load_act<kInt4>(params, cur, wtid, ra);
  // Two stages an iteration, so that which register set holds which stage is known at compile
  // time (an indexed set would live in local memory).
#pragma unroll 1
  for (;;) {
    FusedCursor next = cur;
    bool more = fused_next(params, sm, w, next);
    if constexpr (kGrouped<P>) {
      if (more && next.kb == 0) publish(next);
    }
    claim(cur);
    if (more) fused_load_act<kInt4>(params, next, wtid, rb);
    fill(ra);
    if (!more) break;
    cur = next;
    more = fused_next(params, sm, w, next);
    if constexpr (kGrouped<P>) {
      if (more && next.kb == 0) publish(next);
    }
    claim(cur);
    if (more) fused_load_act<kInt4>(params, next, wtid, ra);
    fill(rb);
    if (!more) break;
    cur = next;
  }
}

// A barrier for consumer warpgroup wg's 128 threads alone (named barriers 1 and 2; 0 is
// __syncthreads'), its id an immediate so that ptxas reserves just those two.
__device__ __forceinline__ void fused_warpgroup_sync(int wg) {
  if (wg == 0) {
    ptx::named_barrier_sync<1>(128);
  } else {
    ptx::named_barrier_sync<2>(128);
  }
}

// The epilogue of one warpgroup's tile: each accumulator scaled by 2^fold (the weights carried
// 2^-fold), then the tensor scale and bias (write_final's order), staged in shared memory as
// token rows of the warpgroup's 64 columns, and stored to C in 16-byte pieces, 8 neighbouring
// threads a C row. FP32 C takes two passes of 64 tokens (the staging holds 16 KiB).
template <bool kF32, class P>
__device__ __forceinline__ void fused_epilogue(const P& params, const FusedSmem<kGrouped<P>>& sm,
                                               const FusedTile& ft, float (&acc)[fu::kTokens / 2],
                                               float fold, int wg, int wtid) {
  const GemmParams& p = gemm_of(params);
  // C's elements as bits: FP32 or BF16.
  using Elem = std::conditional_t<kF32, std::uint32_t, std::uint16_t>;
  constexpr int kElem = sizeof(Elem), kRowBytes = fu::kRowsPerConsumer * kElem;
  constexpr int kPasses = kF32 ? 2 : 1, kPassTokens = fu::kTokens / kPasses;
  constexpr int kPassRegs = fu::kTokens / 2 / kPasses, kChunksPerRow = kRowBytes / 16;
  const std::uint32_t staging = sm.staging(wg);
  const std::int64_t col0 = std::int64_t{ft.n0} + fu::kRowsPerConsumer * wg;
  // Register i's staging byte is register i % 4's plus 8 (i / 4) token rows (fu::fused_stage_offset
  // of a token 8 further on): four offsets a thread rather than one per register.
  std::uint32_t first[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    first[r] = staging + fu::fused_stage_offset(fu::fused_out_row(wtid, r),
                                                tiles::wgmma_acc_row(wtid, r) * kElem, kRowBytes);
  }
  // A thread's registers cover two columns (rows g and g + 8 of its warp's 16): their bias and
  // whether they lie inside N, read once. fold is a power of two, so acc * (fold * scale) is
  // write_final's (acc * fold) * scale exactly. The grouped kernel's are its expert's: the
  // tensor scale from the table, the bias row e.
  const std::uint16_t* bias_row = reinterpret_cast<const std::uint16_t*>(p.bias);
  float scale = fold * p.tensor_scale;
  if constexpr (kGrouped<P>) {
    scale = fold * __ldg(reinterpret_cast<const float*>(params.expert_table) + ft.expert());
    if ((p.flags & kGemmBias) != 0) bias_row += std::int64_t{ft.expert()} * p.n;
  }
  float bias[2];
  bool inside[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::int64_t n = col0 + tiles::wgmma_acc_row(wtid, 2 * h);
    inside[h] = n < p.n;
    bias[h] = inside[h] && (p.flags & kGemmBias) ? num::bf16_to_f32(bias_row[n]) : 0.0f;
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
#pragma unroll
    for (int i = pass * kPassRegs; i < (pass + 1) * kPassRegs; ++i) {
      const int h = (i >> 1) & 1;
      // Columns past N are staged too (as 0), so that every thread stores at every step.
      const float v = inside[h] ? acc[i] * scale + bias[h] : 0.0f;
      const std::uint32_t at =
          first[i % 4] + static_cast<std::uint32_t>((i / 4 - pass * kPassRegs / 4) * 8 * kRowBytes);
      if constexpr (kF32) {
        ptx::st_shared4(at, num::f32_bits(v));
      } else {
        ptx::st_shared2(at, static_cast<std::uint16_t>(num::f32_to_bf16(v)));
      }
    }
    fused_warpgroup_sync(wg);  // the warpgroup's staging is written
#pragma unroll
    for (int c = wtid; c < kPassTokens * kChunksPerRow; c += 128) {
      const int token = c / kChunksPerRow, chunk = c % kChunksPerRow;
      const uint4 v =
          ptx::ld_shared16(staging + fu::fused_stage_offset(token, 16 * chunk, kRowBytes));
      const std::int64_t m = std::int64_t{ft.m0} + pass * kPassTokens + token;
      const std::int64_t n = col0 + chunk * (16 / kElem);
      // The grouped tile's rows end at its expert's.
      bool outside = n >= p.n;
      if constexpr (kGrouped<P>) {
        outside |=
            pass * kPassTokens + token >= ft.rows() && !METRALE_FUSED_PLANTED(kNoExpertRowBound);
      } else {
        outside |= m >= p.m;
      }
      if (outside) continue;
      Elem* out = reinterpret_cast<Elem*>(p.out) + m * p.n + n;
      if (n + 16 / kElem <= p.n && reinterpret_cast<std::uintptr_t>(out) % 16 == 0) {
        ptx::stg16(out, v);
        continue;
      }
      for (int j = 0; j < 16 / kElem && n + j < p.n; ++j) {
        const std::uint32_t word = word_of(v, j * kElem / 4);
        out[j] = static_cast<Elem>(kF32 ? word : word >> (16 * (j % 2)));
      }
    }
    fused_warpgroup_sync(wg);  // read before the next pass or tile overwrites it
  }
}

// One consumer warpgroup (wg = 0, 1): 64 weight rows of every tile of this block, of weights W
// (FusedFp4 or FusedInt4).
template <class W, class P>
__device__ void fused_consume(const P& params, const FusedSmem<kGrouped<P>>& sm, int wg, int wtid) {
  constexpr bool kMx = W::kMx;
  const GemmParams& p = gemm_of(params);
  const FusedWalk w = fused_walk(params, sm);
  const int lane = wtid % 32, rt = (wtid / 32) % 2;
  const int per = dl::scale_bytes_per_lane(kMx);
  const int tile_in_block = 2 * wg + wtid / 64;
  // INT4: the lane's decode tile's side slot in a stage.
  const auto side_slot =
      static_cast<std::uint32_t>(fu::kScaleOffset + tile_in_block * fu::kInt4SideSlotBytes);
  // This lane's scale codes in a stage: its tile's slot, its 8 (4) bytes.
  const std::uint32_t scale_at =
      fu::kScaleOffset + tile_in_block * fu::kScaleSlotBytes + lane * per;
  float fold = ldexpf(1.0f, p.weight_fold);
  int stage = 0;
  std::uint32_t phase = 0;
  // The parity of the turn phase this warpgroup waits for next: warpgroup 0 starts on the phase
  // before the first (complete), warpgroup 1 on the first (Note [fused ping-pong]).
  std::uint32_t turn = wg == 0 ? 1u : 0u;
  constexpr int kAcc = fu::kTokens / 2;
  float acc[kAcc];
  // One set of A fragments: ptxas serializes every wgmma (C7513) when registers it reads are
  // written while any wgmma is in flight, so a block's fragments are built only after the
  // previous block's wgmmas retired; the other consumer warpgroup's MMAs run meanwhile.
  std::uint32_t a[fu::kSteps][4];
  const auto arrive = [&](std::uint32_t bar) {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(bar);
  };
  const auto block = [&]() {
    const std::uint32_t at = sm.stage(stage);
    const std::uint32_t parity = METRALE_FUSED_PLANTED(kWrongParity) ? phase ^ 1u : phase;
    ptx::mbarrier_wait(sm.full(stage), parity);
    if constexpr (W::kInt4) {
      // The block's scales and zero points of the lane's two rows; pairs per K block (one
      // entry) or per chunk (a 32-K span each).
      uint4 sc = make_uint4(0, 0, 0, 0);
      uint2 zz = make_uint2(0, 0);
      fused_int4_side<W::kEntries>(at + side_slot, wtid, sc, zz);
      const FusedInt4Scales<W> scales = fused_int4_scales<W>(sc);
      std::uint32_t zp[2], sp[2], lo[2];
      if constexpr (W::kEntries == 1) fused_int4_pairs<W>(scales, zz, 0, zp, sp, lo);
#pragma unroll
      for (int q = 0; q < fu::kSteps / 2; ++q) {
        if constexpr (W::kEntries != 1) fused_int4_pairs<W>(scales, zz, q, zp, sp, lo);
        const uint4 c = ptx::ld_shared16(at + fu::kCodeOffset + fu::fused_chunk_byte(wg, wtid, q));
        fused_int4_fragment<W>(rt != 0 ? c.y : c.x, zp, sp, lo, a[2 * q]);
        fused_int4_fragment<W>(rt != 0 ? c.w : c.z, zp, sp, lo, a[2 * q + 1]);
      }
    } else {
      uint2 sc;
      if constexpr (kMx) {
        sc = make_uint2(ptx::ld_shared4(at + scale_at), 0u);
      } else {
        sc = ptx::ld_shared8(at + scale_at);
      }
      std::uint32_t sp[2][2];
      if constexpr (kGrouped<P>) {
        fused_scale_pairs<kMx>(sc, rt, at + fu::kGroupedTableInStage, sp);
      } else {
        fused_scale_pairs<kMx>(sc, rt, sm.table(), sp);
      }
#pragma unroll
      for (int q = 0; q < fu::kSteps / 2; ++q) {
        const uint4 c = ptx::ld_shared16(at + fu::kCodeOffset + fu::fused_chunk_byte(wg, wtid, q));
        fused_a_fragment(rt != 0 ? c.y : c.x, sp, 2 * q, a[2 * q]);
        fused_a_fragment(rt != 0 ? c.w : c.z, sp, 2 * q + 1, a[2 * q + 1]);
      }
    }
    // All 32 fragment registers are computed here, before the fence: dequantization that the
    // compiler sank between the wgmmas would make ptxas serialize them (C7513).
#pragma unroll
    for (int s = 0; s < fu::kSteps; ++s) {
#pragma unroll
      for (int j = 0; j < 4; ++j) ptx::pin(a[s][j]);
    }
    // This warpgroup's turn (Note [fused ping-pong]): warpgroup 0 goes first.
    if (!METRALE_FUSED_PLANTED(kNoTurns)) {
      ptx::mbarrier_wait(sm.turn(wg), turn);
    }
    turn ^= 1u;
    ptx::wgmma_fence();  // the fragments (and accumulators) written above, before wgmma reads them
#pragma unroll
    for (int s = 0; s < fu::kSteps; ++s) {
      ptx::wgmma_bf16_m64n128k16_rs(acc, a[s], fu::fused_b_desc(at, s));
    }
    ptx::wgmma_commit();
    arrive(sm.turn(1 - wg));  // the other warpgroup's turn: its wgmmas queue behind these
    if (METRALE_FUSED_PLANTED(kEarlyRelease)) arrive(sm.empty(stage));
    ptx::wgmma_wait<0>();  // this block's wgmmas are done: the stage and the fragments are free
    if (!METRALE_FUSED_PLANTED(kEarlyRelease)) arrive(sm.empty(stage));
    if (++stage == fu::kStages) {
      stage = 0;
      phase ^= 1u;
    }
  };
#pragma unroll 1
  for (int tile = w.first; tile < w.tiles; tile += w.stride) {
    // The grouped kernel reads its tile from the producer's ring after the MMA loop (Note
    // [grouped fused tiles]): entry tile / stride, the block's tile count so far (first <
    // stride), divided out rather than counted, one register fewer across the loop.
    FusedTile ft;
    if constexpr (!kGrouped<P>) ft = fused_tile_of(params, sm, w, tile);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
#pragma unroll 1
    for (int kb = 0; kb < w.kb_count; ++kb) block();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_regs(acc[i]);
    if constexpr (kGrouped<P>) {  // and the expert's fold (kernels/grouped_params.h's table)
      const uint4 info = ptx::ld_shared16(sm.tile_info(tile / w.stride));
      ft.m0 = static_cast<int>(info.x);
      ft.n0 = static_cast<int>(info.y);
      ft.expert_rows = static_cast<int>(info.z);
      const auto* table = reinterpret_cast<const float*>(params.expert_table);
      fold = ldexpf(
          1.0f, __ldg(reinterpret_cast<const std::int32_t*>(table + params.experts) + ft.expert()));
    }
    if (p.flags & kGemmOutF32) {
      fused_epilogue<true>(params, sm, ft, acc, fold, wg, wtid);
    } else {
      fused_epilogue<false>(params, sm, ft, acc, fold, wg, wtid);
    }
  }
}

// One block of gemm_fused (P = GemmParams) or gemm_grouped_fused (GroupedGemmParams; kInt4:
// gemm_grouped_int4_fused) on `smem`, its fu::kSmemBytes (kGroupedSmemBytes) of dynamic shared
// memory.
template <bool kInt4 = false, class P>
__device__ __forceinline__ void fused_block_on(const P& params, unsigned char* smem) {
  static_assert(!kInt4 || kGrouped<P>, "INT4 weights take the grouped kernel only");
  const GemmParams& p = gemm_of(params);
  FusedSmem<kGrouped<P>> sm;
  // wgmma's swizzle is a function of the address: the layout starts on a 1024-byte boundary.
  const std::uint32_t raw = ptx::smem_addr(smem);
  sm.base = (raw + 1023u) & ~1023u;
  if constexpr (kGrouped<P>) {
    fused_first_slots(params, sm);  // each tile's scale table comes with its stage
  } else {
    auto* table = reinterpret_cast<std::uint32_t*>(smem + (sm.base - raw) + fu::kTableOffset);
    static_assert(fu::kThreads >= dl::kTableEntries, "one table entry a thread");
    if (threadIdx.x < dl::kTableEntries) {
      table[threadIdx.x] = __ldg(reinterpret_cast<const unsigned*>(p.scales) + threadIdx.x);
    }
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < fu::kStages; ++s) {
      ptx::mbarrier_init(sm.full(s), 128);                  // every producer thread
      ptx::mbarrier_init(sm.empty(s), fu::kConsumers * 4);  // every consumer warp
    }
    for (int g = 0; g < fu::kConsumers; ++g)
      ptx::mbarrier_init(sm.turn(g), 4);  // the other's warps
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, wtid = threadIdx.x % 128;
  const bool mx = (p.flags & kGemmMxfp4) != 0;
  // Registers move from the consumers to the producer (Note [fused pipeline]): its two sets of
  // activations need more than the 168 a thread is launched with, the consumers fewer.
  if (wg == 0) {
    ptx::setmaxnreg_inc<fu::kProducerRegisters>();
    if constexpr (kInt4) {
      fused_produce<true, false>(params, sm, wtid);
    } else if (mx) {
      fused_produce<false, true>(params, sm, wtid);
    } else {
      fused_produce<false, false>(params, sm, wtid);
    }
    return;
  }
  ptx::setmaxnreg_dec<fu::kConsumerRegisters>();
  if constexpr (kInt4) {
    // The two side shapes (int4_decode::entries) by two scale formats.
    const bool f16 = (p.flags & kGemmFp16Scales) != 0;
    if (i4::entries(p.group) == 1) {
      if (f16) {
        fused_consume<FusedInt4<1, true>>(params, sm, wg - 1, wtid);
      } else {
        fused_consume<FusedInt4<1, false>>(params, sm, wg - 1, wtid);
      }
    } else if (f16) {
      fused_consume<FusedInt4<4, true>>(params, sm, wg - 1, wtid);
    } else {
      fused_consume<FusedInt4<4, false>>(params, sm, wg - 1, wtid);
    }
  } else if (mx) {
    fused_consume<FusedFp4<true>>(params, sm, wg - 1, wtid);
  } else {
    fused_consume<FusedFp4<false>>(params, sm, wg - 1, wtid);
  }
}

#if !defined(METRALE_KERNEL_HOST_EMULATION)
// One block of gemm_fused (the entry in w4a16.cu).
__device__ void fused_block_sm90(const GemmParams& p) {
  extern __shared__ unsigned char smem_raw[];
  fused_block_on(p, smem_raw);
}

// One block of gemm_grouped_fused (the entry in w4a16.cu).
__device__ void grouped_fused_block_sm90(const GroupedGemmParams& g) {
  extern __shared__ unsigned char smem_raw[];
  fused_block_on(g, smem_raw);
}

// One block of gemm_grouped_int4_fused (the entry in w4a16.cu).
__device__ void grouped_int4_fused_block_sm90(const GroupedGemmParams& g) {
  extern __shared__ unsigned char smem_raw[];
  fused_block_on<true>(g, smem_raw);
}
#endif

#endif  // METRALE_HAVE_WGMMA

}  // namespace metrale::kernels
