// Module "fp8" on the GPU: the W8A8 op's activation cast (cast_e4m3_block128; the rules in
// src/kernels/fp8_cast.h, its host twin in src/cpu/kernels/fp8_cpu.cpp), and the grouped W8A8
// GEMM over experts (gemm_grouped_e4m3_block128, kernels/grouped_fp8_params.h).
//
// The cast: a warp per (row, 128-K block) pair; each lane reads 4 BF16 of the block (strided by
// 32, so the warp's loads are coalesced), the warp reduces their largest magnitude, and each lane
// writes its 4 codes; lane 0 writes the block's scale. Publishes the pairs one block covers
// (n_tile) and its block size.
//
// The grouped GEMM, for decode (few rows per expert): a block per (32 columns, expert), a warp per
// 4 columns, each lane 16 K at a time (16 bytes of a weight row, inside one 128-K scale block),
// 2 of the expert's rows at once and an odd last row alone (decode_pass<2>, decode_pass<1>: a
// token's expert at decode has one row, and its pass then costs one row's FFMAs and conversions,
// not two). Codes widen to FP32 through FP16 exactly
// (num::e4m3x4_to_f16_scaled); each lane's 16-product sum is scaled by its block's A and W scales
// and summed, then the warp's lanes are. Weights are read once per 2 rows, so an expert with many
// rows (prefill) re-reads them from L2: correct, not fast there.
//
// The grouped GEMM for prefill, gemm_grouped_e4m3_block128_tiled (grouped_e4m3_sm90.cuh, sm_90a):
// tiles of 128 of an expert's rows x 128 weight rows on the FP8 tensor cores, each block walking
// the layer's tiles, so an expert's weights are read once per 128 rows. Without wgmma the entry
// is a placeholder that publishes _absent.
#include <cstdint>

#include "grouped_e4m3_sm90.cuh"
#include "kernels/fp8_cast.h"
#include "kernels/grouped_fp8_params.h"
#include "kernels/grouped_fp8_tiles.h"
#include "kernels/verified_devices.h"
#include "metrale/numerics.h"
#include "ptx.cuh"

namespace {

namespace f = metrale::fp8;
namespace gt = metrale::grouped_fp8::tiled;
namespace num = metrale::num;

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;  // pairs per block
constexpr unsigned kPerLane = f::kCastBlock / 32;

constexpr unsigned kGemmThreads = 256;
constexpr int kWarpCols = 4;                                     // columns of C per warp
constexpr unsigned kGemmTile = kWarpCols * (kGemmThreads / 32);  // columns per block
constexpr int kPassRows = 2;                                     // an expert's rows per pass
constexpr int kChunk = 16;  // K per lane per step: one 16-byte load

// 16 E4M3 codes (one 16-byte load) as floats, each 2^-8 times the code's value.
__device__ __forceinline__ void widen16(uint4 v, float (&x)[kChunk]) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    std::uint32_t p02, p13;
    num::e4m3x4_to_f16_scaled(words[i], &p02, &p13);
    num::f16x2_to_f32(p02, &x[4 * i], &x[4 * i + 2]);
    num::f16x2_to_f32(p13, &x[4 * i + 1], &x[4 * i + 3]);
  }
}

// One warp's share of the decode kernel's block: its 4 columns of expert e's rows.
struct DecodeWarp {
  const metrale::GroupedFp8Params* g;
  std::int64_t e, first, n0, cols, lda, ldw;
  unsigned lane;
  const std::uint8_t *w, *a;
  const float *ws, *as;
};

// Rows [r0, r0 + kRows) of the warp's columns: each lane 16 K at a time, each row's 16 products
// scaled by its block's A and W scales, the lanes' sums reduced, lane r·4 + c storing (r, c).
template <int kRows>
__device__ __forceinline__ void decode_pass(const DecodeWarp& d, std::int64_t r0) {
  const metrale::GroupedFp8Params& g = *d.g;
  float acc[kRows][kWarpCols] = {};
  for (std::int64_t k0 = std::int64_t{d.lane} * kChunk; k0 < g.k; k0 += 32 * kChunk) {
    const std::int64_t kb = k0 / f::kCastBlock;
    float x[kRows][kChunk];
    float xs[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      widen16(metrale::ptx::ldg16(d.a + (r0 + r) * g.k + k0), x[r]);
      xs[r] = d.as[kb * d.lda + r0 + r];
    }
#pragma unroll
    for (int c = 0; c < kWarpCols; ++c) {
      if (c >= d.cols) break;
      float y[kChunk];
      widen16(metrale::ptx::ldg16(d.w + c * g.k + k0), y);
      const float s = d.ws[((d.n0 + c) / f::kCastBlock) * d.ldw + kb];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < kChunk; ++i) v = fmaf(x[r][i], y[i], v);
        acc[r][c] += metrale::grouped_fp8::scaled_partial(v, xs[r], s);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < kWarpCols; ++c) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], off);
      }
    }
  }
  // Lane r·4 + c writes element (r, c): every lane holds every sum after the XOR reduction.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < kWarpCols; ++c) {
      if (d.lane != static_cast<unsigned>(r * kWarpCols + c) || c >= d.cols) continue;
      const std::int64_t row = d.first + r0 + r, col = d.n0 + c;
      float v = acc[r][c];
      if (g.bias != 0) {
        v += num::bf16_to_f32(reinterpret_cast<const std::uint16_t*>(g.bias)[d.e * g.n + col]);
      }
      if (g.out_f32 != 0) {
        reinterpret_cast<float*>(g.c)[row * g.n + col] = v;
      } else {
        reinterpret_cast<std::uint16_t*>(g.c)[row * g.n + col] = num::f32_to_bf16(v);
      }
    }
  }
}

}  // namespace

extern "C" {

__global__ void cast_e4m3_block128(metrale::Fp8CastParams p);

__global__ void gemm_grouped_e4m3_block128(metrale::GroupedFp8Params g);

__global__ void gemm_grouped_e4m3_block128_tiled(metrale::GroupedFp8Params g);

__device__ std::uint32_t cast_e4m3_block128_n_tile = kWarps;
__device__ std::uint32_t cast_e4m3_block128_block_threads = kThreads;

// Run 6 of 2026-12-04 on an H200 (docs/GPU.md) ran this entry's sm_90a code through the W8A8
// numerics suite and `metrale check`; no other target's code has run on a GPU.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
METRALE_VERIFIED(cast_e4m3_block128, H200, 20261204);
#endif

// No device run has verified the grouped GEMM: ops/grouped_fp8.h runs it only for a caller that
// opts in.
__device__ std::uint32_t gemm_grouped_e4m3_block128_n_tile = kGemmTile;
__device__ std::uint32_t gemm_grouped_e4m3_block128_block_threads = kGemmThreads;
__device__ std::uint32_t gemm_grouped_e4m3_block128_out_f32 = 1;

// The tiled kernel walks the layer's tiles itself (_persistent: one wave of blocks whatever the
// routing). Its _min_m, rows per expert on average from which kAuto would take it, is modelled,
// not measured: the decode kernel above reads an expert's weights once per 2 rows, this one once
// per 128, so from 16 rows (the decode kernels' bound elsewhere) the weights' bytes dominate. No
// device run has verified it, so kAuto does not take it yet.
#if defined(METRALE_HAVE_WGMMA)
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_n_tile = gt::kNTile;
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_m_tile = gt::kMTile;
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_smem_bytes = gt::kSmemBytes;
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_block_threads = gt::kThreads;
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_out_f32 = 1;
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_persistent = 1;
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_blocks_per_sm = 1;
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_min_m = 16;
#else
__device__ std::uint32_t gemm_grouped_e4m3_block128_tiled_absent = 1;
#endif

__global__ void __launch_bounds__(kThreads) cast_e4m3_block128(metrale::Fp8CastParams p) {
  const std::int64_t kblocks = (p.k + f::kCastBlock - 1) / f::kCastBlock;
  const std::int64_t pair = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (pair >= p.m * kblocks) return;  // whole warps leave together: the shuffles stay full
  const unsigned lane = threadIdx.x % 32;
  const std::int64_t m = pair / kblocks, kb = pair % kblocks;
  const std::int64_t k0 = kb * f::kCastBlock;
  const auto* in = reinterpret_cast<const std::uint16_t*>(p.in) + m * p.k;
  auto* codes = reinterpret_cast<std::uint8_t*>(p.codes) + m * p.k;
  float x[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (unsigned j = 0; j < kPerLane; ++j) {
    const std::int64_t q = k0 + lane + 32 * j;
    x[j] = q < p.k ? num::bf16_to_f32(in[q]) : 0.0f;
    amax = f::amax_step(amax, x[j]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    amax = f::amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  }
  const float s = f::block_scale(amax);
#pragma unroll
  for (unsigned j = 0; j < kPerLane; ++j) {
    const std::int64_t q = k0 + lane + 32 * j;
    if (q < p.k) codes[q] = f::encode(x[j], s);
  }
  if (lane == 0) reinterpret_cast<float*>(p.scales)[kb * f::scales_ld(p.m) + m] = s;
}

// The second bound (at least 2 blocks an SM) lets ptxas use what the passes need: without it,
// sm_80 and sm_89 code kept 80 registers and spilled 4 bytes. They take 72-84, 3 blocks an SM.
__global__ void __launch_bounds__(kGemmThreads, 2)
    gemm_grouped_e4m3_block128(metrale::GroupedFp8Params g) {
  std::int64_t first = 0, m = 0;
  if (!metrale::grouped_fp8::expert_rows(g, blockIdx.y, &first, &m)) return;
  const std::int64_t n0 =
      std::int64_t{blockIdx.x} * kGemmTile + std::int64_t{threadIdx.x / 32} * kWarpCols;
  if (n0 >= g.n) return;  // whole warps leave together: the shuffles stay full
  const auto e = static_cast<std::uint64_t>(blockIdx.y);
  const std::int64_t kblocks = (g.k + f::kCastBlock - 1) / f::kCastBlock;
  DecodeWarp d;
  d.g = &g;
  d.e = static_cast<std::int64_t>(e);
  d.first = first;
  d.n0 = n0;
  d.cols = g.n - n0 < kWarpCols ? g.n - n0 : kWarpCols;
  d.lane = threadIdx.x % 32;
  d.w = reinterpret_cast<const std::uint8_t*>(g.b + e * g.b_stride) + n0 * g.k;
  d.ws = reinterpret_cast<const float*>(g.b_scales + e * g.b_scales_stride);
  d.a = reinterpret_cast<const std::uint8_t*>(g.a) + first * g.k;
  d.as = reinterpret_cast<const float*>(g.a_scales) + first;
  d.lda = f::scales_ld(g.rows);
  d.ldw = (kblocks + 3) / 4 * 4;
  // Pairs of rows, and a last row alone: a pass's FFMAs and conversions are per row, so an odd
  // row (one token's expert at decode) costs one row's, not two.
  std::int64_t r0 = 0;
#pragma unroll 1
  for (; r0 + kPassRows <= m; r0 += kPassRows) decode_pass<kPassRows>(d, r0);
  if (r0 < m) decode_pass<1>(d, r0);
}

// The prefill kernel (grouped_e4m3_sm90.cuh): one block an SM (its stages take 129 KiB of shared
// memory). A placeholder without wgmma: the op refuses it, and a launch that got here anyway
// traps rather than leave C unwritten.
__global__ void __launch_bounds__(gt::kThreads, 1)
    gemm_grouped_e4m3_block128_tiled(metrale::GroupedFp8Params g) {
#if defined(METRALE_HAVE_WGMMA)
  metrale::kernels::grouped_e4m3_tiled_sm90(g);
#else
  (void)g;
  __trap();
#endif
}

}  // extern "C"
