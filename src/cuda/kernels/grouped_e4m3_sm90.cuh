// gemm_grouped_e4m3_block128_tiled: the grouped W8A8 GEMM's prefill kernel on Hopper's FP8
// tensor cores (wgmma E4M3, QGMMA in SASS), sm_90a only. Every expert's rows of a layer in one
// launch: each block walks tiles b, b + grid, ... of the layer, a tile being 128 of an expert's
// rows (one slot, grouped_slots.cuh) x 128 of its weight rows (index math: kernels/
// grouped_fp8_tiles.h; why: Note [grouped FP8 tiles] in docs/NOTES.md).
// - A (the cast activations) and W (the expert's E4M3 codes, row-major [N, K]) stream through
//   four stages of one 128-K scale block each, copied by every thread with cp.async in 16-byte
//   chunks into 128-byte-swizzled rows, zero past the tile's rows, N and K;
// - each warpgroup (64 of the tile's rows) issues the stage's four m64n128k32 MMAs into a fresh
//   FP32 tile and waits for them, then adds it times the row's A scale and the tile's one W scale
//   (its 128 columns lie in one 128-column scale block) to the accumulator: the products of a
//   block are summed by the tensor cores, the blocks in FP32;
// - the epilogue adds the expert's bias row and stores its rows of C, BF16 or FP32.
// The host runs this source as the GPU would (tests/kernels/emulation/fp8_host_test.cpp): its
// cp.async copies landing late and in any order, wgmma from the PTX ISA's fragment rules.
#pragma once

#include <cstdint>

#include "grouped_slots.cuh"
#include "kernels/fp8_cast.h"
#include "kernels/fused_tile.h"
#include "kernels/grouped_fp8_params.h"
#include "kernels/grouped_fp8_tiles.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"
#include "ptx.cuh"

namespace metrale::kernels {

#if defined(METRALE_HAVE_WGMMA)

namespace gt = metrale::grouped_fp8::tiled;

// A fault the host emulation plants to show that its checks catch it
// (tests/kernels/emulation/fp8_host_test.cpp); a constant false on the device.
#if defined(METRALE_KERNEL_HOST_EMULATION)
#define METRALE_TILED_PLANTED(what) \
  (::metrale::emulation::planted(::metrale::emulation::Plant::what))
#else
#define METRALE_TILED_PLANTED(what) false
#endif

// The block's dynamic shared memory (the host's arena under the emulation).
__device__ __forceinline__ unsigned char* grouped_e4m3_smem() {
#if defined(METRALE_KERNEL_HOST_EMULATION)
  return ::metrale::emulation::shared_memory();
#else
  extern __shared__ unsigned char smem_raw[];
  return smem_raw;
#endif
}

// Expert e's columns [n0, n0 + 128) of C for A's rows [r0, r0 + rows), rows <= 128. Every thread
// of the block calls it; it ends with __syncthreads, so the next tile's copies overwrite no stage
// a warpgroup still reads.
__device__ __forceinline__ void grouped_e4m3_tile(const GroupedFp8Params& g, std::uint32_t base,
                                                  std::int64_t e, std::int64_t r0, int rows,
                                                  std::int64_t n0) {
  namespace tl = metrale::tiles;
  const int wg = threadIdx.x / 128, wtid = threadIdx.x % 128;
  const auto a_addr = [&](int s) { return base + static_cast<std::uint32_t>(s * gt::kStageBytes); };
  const auto b_addr = [&](int s) { return a_addr(s) + static_cast<std::uint32_t>(gt::kABytes); };
  const std::int64_t k_tiles = (g.k + gt::kKStage - 1) / gt::kKStage;
  const std::int64_t lda = fp8::scales_ld(g.rows), ldw = (k_tiles + 3) / 4 * 4;
  const auto* a = reinterpret_cast<const std::uint8_t*>(g.a);
  const auto* w =
      reinterpret_cast<const std::uint8_t*>(g.b + static_cast<std::uint64_t>(e) * g.b_stride);
  const auto* a_scales = reinterpret_cast<const float*>(g.a_scales) + r0;
  const std::int64_t e_scales = METRALE_TILED_PLANTED(kExpertZeroTable) ? 0 : e;
  const auto* w_scales =
      reinterpret_cast<const float*>(g.b_scales +
                                     static_cast<std::uint64_t>(e_scales) * g.b_scales_stride) +
      (n0 / gt::kNTile) * ldw;

  // Thread t copies chunk t % 8 (16 K) of rows t / 8 + 32 i of A and of W.
  const int q = static_cast<int>(threadIdx.x % 8);
  const auto chunk_at = [](int row, int chunk) {
    return METRALE_TILED_PLANTED(kWrongSwizzle)
               ? static_cast<std::uint32_t>(128 * row + 16 * chunk)
               : tl::swizzle128(static_cast<std::uint32_t>(row),
                                static_cast<std::uint32_t>(16 * chunk));
  };
  const auto load_stage = [&](int s, std::int64_t kt) {
    const std::int64_t k = kt * gt::kKStage + 16 * q;
#pragma unroll
    for (int i = 0; i < gt::kAChunks; ++i) {
      const int row = static_cast<int>(threadIdx.x / 8) + 32 * i;
      const bool in = row < rows && k < g.k;
      ptx::cp_async16(a_addr(s) + chunk_at(row, q), in ? a + (r0 + row) * g.k + k : a, in ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < gt::kBChunks; ++i) {
      const int row = static_cast<int>(threadIdx.x / 8) + 32 * i;
      const bool in = n0 + row < g.n && k < g.k;
      ptx::cp_async16(b_addr(s) + chunk_at(row, q), in ? w + (n0 + row) * g.k + k : w, in ? 16 : 0);
    }
  };

  // The thread's two rows of the tile (wgmma D fragments: rows g and g + 8 of its warp's 16).
  const int row_lo = 64 * wg + tl::wgmma_acc_row(wtid, 0), row_hi = row_lo + 8;
  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = part[i] = 0.0f;

#pragma unroll
  for (int s = 0; s < gt::kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    ptx::cp_async_commit();
  }

#pragma unroll 1
  for (std::int64_t kt = 0; kt < k_tiles; ++kt) {
    ptx::cp_async_wait<gt::kStages - 2>();
    // The copies' generic-proxy writes, before wgmma reads them through the async proxy.
    if (!METRALE_TILED_PLANTED(kNoProxyFence)) ptx::fence_proxy_async();
    __syncthreads();

    // Block next into the stage that iteration kt - 1 multiplied: every warpgroup waited for its
    // MMAs there before the barrier above.
    const std::int64_t next = kt + gt::kStages - 1;
    if (next < k_tiles) load_stage(static_cast<int>(next % gt::kStages), next);
    ptx::cp_async_commit();

    // This block's scales, loaded before the MMAs so that their latency hides behind them: the
    // rows' A scales (0 past the tile's rows) and the tile's W scale.
    const float w_scale = __ldg(w_scales + kt);
    const float sa_lo = row_lo < rows ? __ldg(a_scales + kt * lda + row_lo) : 0.0f;
    const float sa_hi = row_hi < rows ? __ldg(a_scales + kt * lda + row_hi) : 0.0f;

    const int cs = static_cast<int>(kt % gt::kStages);
    const std::uint32_t a_wg = a_addr(cs) + static_cast<std::uint32_t>(wg * 64 * gt::kRowBytes);
#pragma unroll
    for (int i = 0; i < 64; ++i) ptx::fence_regs(part[i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int s = 0; s < gt::kKStage / 32; ++s) {
      ptx::wgmma_e4m3_m64n128k32(part, tl::wgmma_desc_sw128(a_wg + 32u * s),
                                 tl::wgmma_desc_sw128(b_addr(cs) + 32u * s),
                                 s > 0 || METRALE_TILED_PLANTED(kPartNotReset));
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    const float f_lo = sa_lo * w_scale, f_hi = sa_hi * w_scale;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      ptx::fence_regs(part[i]);
      acc[i] += part[i] * (((i >> 1) & 1) ? f_hi : f_lo);
    }
  }
  ptx::cp_async_wait<0>();

  // The epilogue: the thread's pairs of neighbouring columns, with the expert's bias, as one
  // 4- or 8-byte store where both lie in N and C's row pairs stay aligned.
  const bool pairs = g.n % 2 == 0 && g.c % 8 == 0;
  const auto* bias = reinterpret_cast<const std::uint16_t*>(g.bias);
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const int row = 64 * wg + tl::wgmma_acc_row(wtid, i);
    const std::int64_t col = n0 + tl::wgmma_acc_col(wtid, i);
    if ((row >= rows && !METRALE_TILED_PLANTED(kNoExpertRowBound)) || col >= g.n) continue;
    const bool two = col + 1 < g.n;
    float v0 = acc[i], v1 = acc[i + 1];
    if (g.bias != 0) {
      v0 += num::bf16_to_f32(bias[e * g.n + col]);
      if (two) v1 += num::bf16_to_f32(bias[e * g.n + col + 1]);
    }
    const std::int64_t at = (r0 + row) * g.n + col;
    if (g.out_f32 != 0) {
      auto* c = reinterpret_cast<float*>(g.c) + at;
      if (two && pairs) {
        *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
      } else {
        c[0] = v0;
        if (two) c[1] = v1;
      }
    } else {
      auto* c = reinterpret_cast<std::uint16_t*>(g.c) + at;
      const std::uint16_t h0 = num::f32_to_bf16(v0), h1 = num::f32_to_bf16(v1);
      if (two && pairs) {
        *reinterpret_cast<std::uint32_t*>(c) = std::uint32_t{h0} | (std::uint32_t{h1} << 16);
      } else {
        c[0] = h0;
        if (two) c[1] = h1;
      }
    }
  }
  __syncthreads();
}

// The kernel's body: every expert's first slot into shared memory, then the block's tiles.
__device__ __forceinline__ void grouped_e4m3_tiled_sm90(const GroupedFp8Params& g) {
  namespace fu = metrale::fused;
  const std::uint32_t raw = ptx::smem_addr(grouped_e4m3_smem());
  const std::uint32_t base = (raw + 1023u) & ~1023u;
  const std::uint32_t first = base + static_cast<std::uint32_t>(gt::kSlotOffset);
  grouped_first_slots<gt::kThreads, gt::kScanEntries>(
      reinterpret_cast<const std::int32_t*>(g.counts),
      reinterpret_cast<const std::int32_t*>(g.offsets), g.experts, g.rows, first);
  const int experts = fu::grouped_experts(g.experts);
  const auto first_slot = [first](int e) {
    return static_cast<int>(ptx::ld_shared_lookup(first + 4u * static_cast<std::uint32_t>(e)));
  };
  const std::int64_t n_tiles = gt::n_tiles(g.n);
  const std::int64_t tiles = std::int64_t{first_slot(experts)} * n_tiles;
#pragma unroll 1
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int slot = static_cast<int>(t / n_tiles);
    const int e = fu::grouped_expert_of(first_slot, experts, slot);
    std::int64_t r0 = 0, m = 0;
    grouped_fp8::expert_rows(g, e, &r0, &m);  // true: only an expert with rows has slots
    const std::int64_t m0 = std::int64_t{slot - first_slot(e)} * gt::kMTile;
    const std::int64_t rows = m - m0 < gt::kMTile ? m - m0 : gt::kMTile;
    grouped_e4m3_tile(g, base, e, r0 + m0, static_cast<int>(rows), (t % n_tiles) * gt::kNTile);
  }
}

#endif  // METRALE_HAVE_WGMMA

}  // namespace metrale::kernels
