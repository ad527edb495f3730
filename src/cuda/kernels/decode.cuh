// The decode GEMM (small M) on tensor cores, sm_80 and later: C^T = W · A^T with the weights as
// the 16-row MMA operand, so M <= 8 fills one n8 tile and M <= 16 two. Each block owns 32
// output columns; its 8 warps take interleaved 128-K blocks and their partial sums meet in
// shared memory in a fixed order. Per K block a lane loads one 16-byte run of codes for each of
// its 4 weight rows and dequantizes in registers: the E4M3/E8M0 block scale is folded into the
// BF16 weight, which is exact (an E2M1 value has 2 significant bits, a scale at most 4). Grid z
// splits K; each slice writes FP32 partials that gemm_split_reduce (split_reduce.cuh) sums in
// slice order. The weight loads and the dequantization are shared with the tiled kernel
// (operands.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode_reduce.cuh"
#include "epilogue.cuh"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"
#include "operands.cuh"
#include "ptx.cuh"

namespace metrale::kernels {

namespace num = metrale::num;
namespace tl = metrale::tiles;

// Weights of one warp's K block: 4 rows (g, g + 8, g + 16, g + 24) of 32 codes with their two
// group scales (equal for MXFP4). Three of these rotate: two K blocks load from HBM while the
// third multiplies.
struct DecodeCodes {
  uint4 codes[4];
  std::uint32_t scale[4];  // each row's raw scale codes (load_scales_raw)
};

// Activations of one warp's K block: MT rows of 32 (L2-resident, loaded just before use).
template <int MT>
struct DecodeActs {
  uint4 act[MT][4];
};

// Lane (g, t)'s weights of the K block at kb, for the 32 rows from n0. Outside [k_begin, k_end)
// or N the codes and the scale codes read as 0, so a NaN scale outside K cannot leak in.
// `interior`: the block's 32 rows lie inside N, this K block inside the slice, and K is a
// multiple of 32 (16-byte code runs, even NVFP4 scale pairs), so the row-major loads need no
// checks at all: two loads per row, as the HBM stream wants.
template <bool kTr>
__device__ __forceinline__ void decode_load_weights(DecodeCodes& f, const GemmParams& p,
                                                    std::int64_t n0, std::int64_t kb,
                                                    std::int64_t k_end, int g, int t,
                                                    bool interior) {
  const std::int64_t k0 = kb + 32 * t;
  if constexpr (!kTr) {
    if (interior) {
      const bool mx = p.flags & kGemmMxfp4;
      const std::int64_t row_bytes = p.k / 2, groups = mx ? p.k / 32 : p.k / 16;
      const std::int64_t n = n0 + g, g0 = mx ? k0 / 32 : k0 / 16;
      const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes) + n * row_bytes + k0 / 2;
      const auto* sc = reinterpret_cast<const std::uint8_t*>(p.scales) + n * groups + g0;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        f.codes[r] = ptx::ldg16(codes + 8 * r * row_bytes);
        f.scale[r] = ldg_scales_raw(sc + 8 * r * groups, mx);
      }
      return;
    }
  }
  const int valid = valid_k(kb, k_end, t);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const std::int64_t n = n0 + g + 8 * r;
    f.codes[r] = load_codes<kTr>(p, n, k0, valid);
    f.scale[r] = load_scales_raw<kTr>(p, n, k0, valid);
  }
}

// Lane (g, t)'s activations of the K block at kb: rows m0 + 8 mt + g, zero outside M and K.
template <int MT>
__device__ __forceinline__ void decode_load_acts(DecodeActs<MT>& f, const GemmParams& p,
                                                 std::int64_t m0, std::int64_t kb,
                                                 std::int64_t k_end, int g, int t) {
  const std::int64_t k0 = kb + 32 * t;
  const int valid = valid_k(kb, k_end, t);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const std::int64_t m = m0 + 8 * mt + g;
    const auto* row = reinterpret_cast<const std::uint16_t*>(p.a) + m * p.k + k0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const bool in = m < p.m && 8 * c < valid;
      f.act[mt][c] = in ? ptx::ldg16(row + 8 * c) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Half-word i of v and chunk i of v, by selects as word_of (operands.cuh).
__device__ __forceinline__ std::uint32_t halfword_of(const uint4& v, int i) {
  return (word_of(v, i / 2) >> (16 * (i % 2))) & 0xFFFFu;
}
__device__ __forceinline__ uint4 chunk_of(const uint4 (&v)[4], int i) {
  return i == 0 ? v[0] : i == 1 ? v[1] : i == 2 ? v[2] : v[3];
}

// The 8 MMA steps of one K block into acc[row tile][activation tile].
template <int MT>
__device__ __forceinline__ void decode_mma(const GemmParams& p, float (&acc)[2][MT][4],
                                           const DecodeCodes& f, const DecodeActs<MT>& x4,
                                           const std::uint32_t* scale_pairs) {
  // Each row's two scales as BF16 pairs, once per K block, from the block's table (a shared
  // load instead of a conversion's two dozen instructions).
  std::uint32_t sp[4][2];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) sp[r][h] = scale_pair_of_raw(p, scale_pairs, f.scale[r], h);
  }
  // Fully unrolled, so every byte, word and scale index below is a constant and selects
  // nothing at run time (see Note [decode steps fully unrolled] in docs/NOTES.md).
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    // The lane's bytes for j = 0, 1 and j = 2, 3 of step s, its activation words for the same,
    // and the scale group: the index math host tests check (tile_math.h).
    const int byte01 = tl::decode_code_byte(s, 0);
    const int word01 = tl::decode_act_word(s, 0), word23 = tl::decode_act_word(s, 2);
    const bool second = tl::decode_group(s) != 0;
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
      const uint4& lo_row = f.codes[2 * rt];      // row g (+16 rt)
      const uint4& hi_row = f.codes[2 * rt + 1];  // row g + 8 (+16 rt)
      // Bytes byte01 (even) and byte01 + 1 hold j = 0..3 (tile_math_test): one half-word.
      std::uint32_t lo_codes = halfword_of(lo_row, byte01 / 2);
      std::uint32_t hi_codes = halfword_of(hi_row, byte01 / 2);
      // Converted here, after the previous step's MMA, not all hoisted to the top.
      ptx::pin(lo_codes);
      ptx::pin(hi_codes);
      // Fragment registers: (row g, j = 0,1), (row g + 8, j = 0,1), (g, j = 2,3), (g + 8, 2,3).
      std::uint32_t a[4];
      dequant_quad(lo_codes, second ? sp[2 * rt][1] : sp[2 * rt][0], &a[0], &a[2]);
      dequant_quad(hi_codes, second ? sp[2 * rt + 1][1] : sp[2 * rt + 1][0], &a[1], &a[3]);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 x01 = chunk_of(x4.act[mt], word01 / 4), x23 = chunk_of(x4.act[mt], word23 / 4);
        ptx::mma_bf16_16816(acc[rt][mt], a, word_of(x01, word01 % 4), word_of(x23, word23 % 4));
      }
    }
  }
}

// Rows m0 .. m0 + 8 MT - 1 of the block's 32 columns over K slice [k_begin, k_end).
template <int MT, bool kTr>
__device__ void decode_rows(const GemmParams& p, std::int64_t n0, std::int64_t m0,
                            std::int64_t k_begin, std::int64_t k_end,
                            float (*red)[tl::kDecodeNTile][tl::kDecodeMaxM],
                            const std::uint32_t* scale_pairs) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  float acc[2][MT][4] = {};
  std::int64_t kb = k_begin + std::int64_t{warp} * tl::kDecodeKBlock;
  constexpr std::int64_t kStride = std::int64_t{tl::kDecodeWarps} * tl::kDecodeKBlock;
  // Register sets of weights in rotation: while one K block multiplies, the others are in
  // flight from HBM (three sets, about 4 KiB per warp, for the row-major layout; two for the
  // transposed one, whose byte gathers need the registers the third would take). The sets trade
  // roles by constant index in an unrolled loop: a register copy would wait for the load it
  // copies.
  constexpr int kSets = kTr ? 2 : 3;
  const bool rows_inside = n0 + tl::kDecodeNTile <= p.n && p.k % 32 == 0;
  const auto load = [&](DecodeCodes& into, std::int64_t at) {
    decode_load_weights<kTr>(into, p, n0, at, k_end, g, t,
                             rows_inside && at + tl::kDecodeKBlock <= k_end);
  };
  const auto step = [&](std::int64_t at, const DecodeCodes& ready, DecodeCodes& fill) {
    const std::int64_t ahead = at + (kSets - 1) * kStride;
    if (ahead < k_end) load(fill, ahead);
    DecodeActs<MT> acts;
    decode_load_acts(acts, p, m0, at, k_end, g, t);
    decode_mma<MT>(p, acc, ready, acts, scale_pairs);
  };
  DecodeCodes w[kSets];
#pragma unroll
  for (int i = 0; i + 1 < kSets; ++i) {
    if (kb + i * kStride < k_end) load(w[i], kb + i * kStride);
  }
#pragma unroll 1
  for (; kb < k_end; kb += kSets * kStride) {
#pragma unroll
    for (int i = 0; i < kSets; ++i) {
      if (kb + i * kStride < k_end) step(kb + i * kStride, w[i], w[(i + kSets - 1) % kSets]);
    }
  }
  store_decode_rows<MT>(p, acc, n0, m0, 1.0f, red);
}

template <bool kTr>
__device__ void decode_block_of(const GemmParams& p,
                                float (*red)[tl::kDecodeNTile][tl::kDecodeMaxM],
                                const std::uint32_t* scale_pairs) {
  const std::int64_t n0 = std::int64_t{blockIdx.x} * tl::kDecodeNTile;
  std::int64_t k_begin = 0, k_end = p.k;
  if (p.splits > 1) tl::split_k_range(p.k, p.k_per_split, blockIdx.z, &k_begin, &k_end);
  // M beyond 16 (a caller forcing this route) repeats the weights once per 16 rows.
  for (std::int64_t m0 = 0; m0 < p.m; m0 += tl::kDecodeMaxM) {
    if (p.m - m0 <= 8) {
      decode_rows<1, kTr>(p, n0, m0, k_begin, k_end, red, scale_pairs);
    } else {
      decode_rows<2, kTr>(p, n0, m0, k_begin, k_end, red, scale_pairs);
    }
  }
}

__device__ void decode_block(const GemmParams& p) {
  __shared__ float red[tl::kDecodeWarps][tl::kDecodeNTile][tl::kDecodeMaxM];
  static_assert(tl::kDecodeThreads == 256, "one scale code a thread");
  __shared__ std::uint32_t scale_pairs[256];
  fill_scale_pairs(p, scale_pairs);
  if (p.flags & kGemmTransposed) {
    decode_block_of<true>(p, red, scale_pairs);
  } else {
    decode_block_of<false>(p, red, scale_pairs);
  }
}

}  // namespace metrale::kernels
