// gemm_fused: the prefill GEMM on weights in the decode layout (kernels/decode_layout.h), sm_90a.
// C^T = W · A^T on wgmma with the weights as the A operand from registers (the RS form) and the
// activations as B from shared memory, warp-specialized (index math and its reasons:
// kernels/fused_tile.h):
// - the producer warpgroup fills a ring of stages (one 128-K block each): its thread 0 has the
//   TMA unit copy the block's packed codes and scale codes (cp.async.bulk, complete_tx on the
//   stage's full barrier), and all its threads load the activations in 16-byte chunks and store
//   them K-permuted into the 128-byte-swizzled tile (a 4x4 word transpose in registers);
// - each consumer warpgroup (64 weight rows, all 128 tokens) reads its decode-layout words from
//   shared memory, dequantizes them in registers with the decode kernel's own conversion
//   (packed_fields, then one BF16x2 multiply by the scale's table pair) while its previous
//   block's wgmmas run, and issues 8 wgmma m64n128k16 RS per block; within the warpgroup only
//   wgmma's fence, commit and wait order the two (no block barrier), and the empty barrier hands
//   the stage back;
// - a tile loop: block b takes tiles b, b + grid, ... in the static order of fused_tiles. The op
//   (src/ops/gemm.cpp) launches one block per tile today, so each block runs one tile and the
//   kernel is not yet persistent: its prologue and epilogue are not hidden (issue 35).
// The epilogue scales by 2^fold and the tensor scale, adds the bias, and stores BF16 transposed
// into C[M, N] (rows past M and columns past N masked).
#pragma once

#include <cstdint>

#include "decode_packed.cuh"
#include "epilogue.cuh"
#include "kernels/decode_layout.h"
#include "kernels/fused_tile.h"
#include "kernels/gemm_params.h"
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
// and the block's table.
template <bool kMx>
__device__ __forceinline__ void fused_scale_pairs(uint2 codes, int rt, const std::uint32_t* table,
                                                  std::uint32_t (&sp)[2][2]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 2 * rt + j, byte = kMx ? r : 2 * r + h;
      const std::uint32_t word = byte < 4 ? codes.x : codes.y;
      sp[j][h] = table[(word >> (8 * (byte % 4))) & 0xFFu];
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

#if defined(METRALE_HAVE_WGMMA)

// Which output tile `tile` is (fused_tiles' order) and how many decode tiles of it exist.
struct FusedTile {
  std::int64_t m0 = 0, n0 = 0;
  int dtiles = 0;
};

__device__ __forceinline__ FusedTile fused_tile_of(const GemmParams& p, std::int64_t tile) {
  const std::int64_t m_tiles = (p.m + fu::kTokens - 1) / fu::kTokens;
  FusedTile t;
  t.m0 = (tile % m_tiles) * fu::kTokens;
  t.n0 = (tile / m_tiles) * fu::kRows;
  const std::int64_t left = dl::padded_n(p.n) / dl::kTileN - t.n0 / dl::kTileN;
  t.dtiles = left < fu::kTilesPerBlock ? static_cast<int>(left) : fu::kTilesPerBlock;
  return t;
}

// The producer warpgroup: every stage of every tile of this block, in the consumers' order.
template <bool kMx>
__device__ void fused_produce(const GemmParams& p, std::uint32_t stages, std::uint32_t full,
                              std::uint32_t empty, int wtid) {
  const std::int64_t kb_count = dl::k_blocks(p.k), tiles = fu::fused_tiles(p.m, p.n);
  const int per = dl::scale_bytes_per_lane(kMx);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes);
  const auto* scales = reinterpret_cast<const std::uint8_t*>(p.scales) + dl::kTableBytes;
  const auto* a = reinterpret_cast<const std::uint16_t*>(p.a);
  const std::int64_t first = std::int64_t{blockIdx.y} * gridDim.x + blockIdx.x;
  const std::int64_t stride = std::int64_t{gridDim.x} * gridDim.y;
  // This thread's 4 units a stage: unit c = wtid + 128 i is token c / 4, K chunk column u = c % 4,
  // so four neighbouring threads read a token's 256 bytes of the block.
  constexpr int kUnits = fu::kTokens * 4 / 128;
  int stage = 0;
  std::uint32_t phase = 0;
  for (std::int64_t tile = first; tile < tiles; tile += stride) {
    const FusedTile ft = fused_tile_of(p, tile);
    for (std::int64_t kb = 0; kb < kb_count; ++kb) {
      const std::uint32_t at = stages + static_cast<std::uint32_t>(stage) * fu::kStageBytes;
      const std::uint32_t full_bar = full + 8u * stage, empty_bar = empty + 8u * stage;
      ptx::mbarrier_wait(empty_bar, phase ^ 1u);  // the consumers released this stage
      if (wtid == 0) {
        const auto bytes =
            static_cast<std::uint32_t>(ft.dtiles * (dl::kTileBlockBytes + dl::kLanes * per));
        ptx::mbarrier_expect_tx(full_bar, bytes);
        for (int q = 0; q < ft.dtiles; ++q) {
          const std::int64_t block = (ft.n0 / dl::kTileN + q) * kb_count + kb;
          ptx::bulk_copy_g2s(at + fu::kCodeOffset + q * dl::kTileBlockBytes,
                             codes + block * dl::kTileBlockBytes, dl::kTileBlockBytes, full_bar);
          ptx::bulk_copy_g2s(at + fu::kScaleOffset + q * fu::kScaleSlotBytes,
                             scales + block * dl::kLanes * per, dl::kLanes * per, full_bar);
        }
      }
      uint4 src[kUnits][4];
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        const int c = wtid + 128 * i, token = c / 4, u = c % 4;
        const std::int64_t m = ft.m0 + token;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          // K is a multiple of 16: a chunk of 8 lies wholly inside or outside.
          const std::int64_t k = kb * fu::kKBlock + 32 * t + 8 * u;
          src[i][t] = m < p.m && k < p.k ? ptx::ldg16(a + m * p.k + k) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int i = 0; i < kUnits; ++i) {
        const int c = wtid + 128 * i, token = c / 4, u = c % 4;
        uint4 dst[4];
        fused_transpose(src[i], dst);
#pragma unroll
        for (int d = 0; d < 4; ++d) {
          ptx::st_shared16(at + fu::fused_act_chunk_offset(token, u, d), dst[d]);
        }
      }
      ptx::fence_proxy_async();  // the stores, to wgmma's async proxy
      ptx::mbarrier_arrive(full_bar);
      if (++stage == fu::kStages) {
        stage = 0;
        phase ^= 1u;
      }
    }
  }
}

// One consumer warpgroup (wg = 0, 1): 64 weight rows of every tile of this block.
template <bool kMx>
__device__ void fused_consume(const GemmParams& p, std::uint32_t stages, std::uint32_t full,
                              std::uint32_t empty, const std::uint32_t* table, int wg, int wtid) {
  const std::int64_t kb_count = dl::k_blocks(p.k), tiles = fu::fused_tiles(p.m, p.n);
  const std::int64_t first = std::int64_t{blockIdx.y} * gridDim.x + blockIdx.x;
  const std::int64_t stride = std::int64_t{gridDim.x} * gridDim.y;
  const int lane = wtid % 32, rt = (wtid / 32) % 2;
  const int per = dl::scale_bytes_per_lane(kMx);
  const int tile_in_block = 2 * wg + wtid / 64;
  // This lane's scale codes in a stage: its tile's slot, its 8 (4) bytes.
  const std::uint32_t scale_at =
      fu::kScaleOffset + tile_in_block * fu::kScaleSlotBytes + lane * per;
  const float fold = ldexpf(1.0f, p.weight_fold);
  int stage = 0;
  std::uint32_t phase = 0;
  constexpr int kAcc = fu::kTokens / 2;
  float acc[kAcc];
  // One set of A fragments: ptxas serializes every wgmma (C7513) when registers it reads are
  // written while any wgmma is in flight, so a block's fragments are built only after the
  // previous block's wgmmas retired; the dequantization of one consumer warpgroup overlaps the
  // other's MMAs instead.
  std::uint32_t a[fu::kSteps][4];
  const auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(empty + 8u * s);
  };
  const auto block = [&]() {
    const std::uint32_t at = stages + static_cast<std::uint32_t>(stage) * fu::kStageBytes;
    ptx::mbarrier_wait(full + 8u * stage, phase);
    uint2 sc;
    if constexpr (kMx) {
      sc = make_uint2(ptx::ld_shared4(at + scale_at), 0u);
    } else {
      sc = ptx::ld_shared8(at + scale_at);
    }
    std::uint32_t sp[2][2];
    fused_scale_pairs<kMx>(sc, rt, table, sp);
#pragma unroll
    for (int s = 0; s < fu::kSteps; ++s) {
      const std::uint32_t w =
          ptx::ld_shared4(at + fu::kCodeOffset + fu::fused_word_byte(wg, wtid, s));
      fused_a_fragment(w, sp, s, a[s]);
    }
    // All 32 fragment registers are computed here, before the fence: dequantization that the
    // compiler sank between the wgmmas would make ptxas serialize them (C7513).
#pragma unroll
    for (int s = 0; s < fu::kSteps; ++s) {
#pragma unroll
      for (int j = 0; j < 4; ++j) ptx::pin(a[s][j]);
    }
    std::uint64_t desc[fu::kSteps];
#pragma unroll
    for (int s = 0; s < fu::kSteps; ++s) {
      desc[s] = fu::fused_b_desc(at, s);
      ptx::pin64(desc[s]);
    }
    ptx::wgmma_fence();  // the fragments (and accumulators) written above, before wgmma reads them
#pragma unroll
    for (int s = 0; s < fu::kSteps; ++s) {
      ptx::wgmma_bf16_m64n128k16_rs(acc, a[s], desc[s]);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();  // this block's wgmmas are done: the stage and the fragments are free
    release(stage);
    if (++stage == fu::kStages) {
      stage = 0;
      phase ^= 1u;
    }
  };
  for (std::int64_t tile = first; tile < tiles; tile += stride) {
    const FusedTile ft = fused_tile_of(p, tile);
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
#pragma unroll 1
    for (std::int64_t kb = 0; kb < kb_count; ++kb) block();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_regs(acc[i]);
      // The weights were multiplied by 2^-fold; the fold comes back with the tensor scale.
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const std::int64_t m = ft.m0 + fu::fused_out_row(wtid, i);
      const std::int64_t n = ft.n0 + fu::fused_out_col(wg, wtid, i);
      if (m < p.m && n < p.n) write_final(p, m * p.n + n, n, acc[i] * fold);
    }
  }
}

template <bool kMx>
__device__ void fused_block_of(const GemmParams& p, const std::uint32_t* table,
                               std::uint32_t stages, std::uint32_t full, std::uint32_t empty) {
  const int wg = threadIdx.x / 128, wtid = threadIdx.x % 128;
  if (wg == 0) {
    fused_produce<kMx>(p, stages, full, empty, wtid);
  } else {
    fused_consume<kMx>(p, stages, full, empty, table, wg - 1, wtid);
  }
}

__device__ void fused_block_sm90(const GemmParams& p) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ std::uint32_t table[dl::kTableEntries];
  __shared__ alignas(8) std::uint64_t bars[2 * fu::kStages];
  // wgmma's swizzle is a function of the address: stages start on 1024-byte boundaries.
  const std::uint32_t stages = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const std::uint32_t full = ptx::smem_addr(bars), empty = full + 8u * fu::kStages;
  static_assert(fu::kThreads >= dl::kTableEntries, "one table entry a thread");
  if (threadIdx.x < dl::kTableEntries) {
    table[threadIdx.x] = __ldg(reinterpret_cast<const unsigned*>(p.scales) + threadIdx.x);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < fu::kStages; ++s) {
      ptx::mbarrier_init(full + 8u * s, 128);                  // every producer thread
      ptx::mbarrier_init(empty + 8u * s, fu::kConsumers * 4);  // every consumer warp
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();
  if (p.flags & kGemmMxfp4) {
    fused_block_of<true>(p, table, stages, full, empty);
  } else {
    fused_block_of<false>(p, table, stages, full, empty);
  }
}

#endif  // METRALE_HAVE_WGMMA

}  // namespace metrale::kernels
