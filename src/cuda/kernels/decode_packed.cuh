// The decode GEMM (small M) on weights in the decode layout (kernels/decode_layout.h), sm_80 and
// later. As gemm_decode: C^T = W · A^T on m16n8k16 tensor cores with the weights as the 16-row
// operand, a block per 32 output columns, its 8 warps on interleaved 128-K blocks summed in
// shared memory in warp order, grid z over K slices (FP32 partials for gemm_split_reduce). What
// the layout buys: a lane's codes for a K block are four 16-byte loads that a warp makes as
// 512 contiguous bytes each, its 8 scale codes one 8-byte load, and each 32-bit word becomes one
// MMA's A fragment with one integer instruction per register (Note [decode layout] in
// docs/NOTES.md). The padding of the layout lets every weight load go unchecked; only the last
// K block of a K that is not a multiple of 128 checks its activation loads.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode_reduce.cuh"
#include "epilogue.cuh"
#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"
#include "operands.cuh"
#include "ptx.cuh"

namespace metrale::kernels {

namespace dl = metrale::decode_layout;
namespace tl = metrale::tiles;

// One K block of a lane's weights: four 16-byte chunks of codes (two MMA steps each) and its
// scale codes (8 bytes for NVFP4, the low 4 for MXFP4).
struct PackedBlock {
  uint4 chunk[dl::kChunks];
  uint2 scale;
};

// (w rotated right by k) & mask. The rotation is a 64-bit multiply by 2^(32 - k), whose halves
// are the two shifted parts: it runs on the FMA pipe, which decode leaves idle, and only the
// mask takes the integer pipe (a funnel shift would take it twice).
template <int kRot>
__device__ __forceinline__ std::uint32_t rotated_fields(std::uint32_t w, std::uint32_t mask) {
  static_assert(kRot > 0 && kRot < 32, "a rotation by 1..31");
  std::uint32_t lo, hi;
  ptx::mul_wide_u32<(1u << (32 - kRot))>(w, lo, hi);
  return (lo | hi) & mask;
}

// The word's A fragment registers as E2M1 values times 2^-126, the four shapes of
// dequant_word_fields (decode_layout.h; the host tests check that function, and this one
// computes the same masks on the same rotations).
__device__ __forceinline__ void packed_fields(std::uint32_t w, std::uint32_t (&r)[4]) {
  r[0] = rotated_fields<dl::kRotate[0]>(w, dl::kFieldMask);
  r[1] = rotated_fields<dl::kRotate[1]>(w, dl::kFieldMask);
  r[2] = rotated_fields<dl::kRotate[2]>(w, dl::kFieldMask);
  r[3] = (w & dl::kKeepMask) | rotated_fields<dl::kRotate3>(w, dl::kRotatedMask3);
}

template <bool kMx>
__device__ __forceinline__ void packed_load(PackedBlock& f, const std::uint8_t* codes,
                                            const std::uint8_t* scales) {
#pragma unroll
  for (int q = 0; q < dl::kChunks; ++q)
    f.chunk[q] = ptx::ldg16(codes + q * dl::kLanes * dl::kChunkBytes);
  if constexpr (kMx) {
    f.scale = make_uint2(__ldg(reinterpret_cast<const unsigned*>(scales)), 0u);
  } else {
    f.scale = ptx::ldg8(scales);
  }
}

// Lane (g, t)'s activations for chunk q of its 32 K from k0 (= 128 kb + 32 t): 8 BF16 of row
// `row` (rows past M read row M - 1, whose products land in columns nobody stores). `checked`:
// zero where the chunk lies past K (the last K block only; K is a multiple of 16, so a chunk
// lies wholly inside or outside).
__device__ __forceinline__ uint4 packed_acts(const std::uint16_t* row, std::int64_t k0, int q,
                                             std::int64_t k, bool checked) {
  const std::int64_t at = k0 + 8 * q;
  if (checked && at >= k) return make_uint4(0, 0, 0, 0);
  return ptx::ldg16(row + at);
}

// The 8 MMA steps of one K block into acc[row tile][activation tile].
template <int MT, bool kMx>
__device__ __forceinline__ void packed_mma(float (&acc)[2][MT][4], const PackedBlock& f,
                                           const std::uint16_t* const (&rows)[MT], std::int64_t k0,
                                           std::int64_t k, bool checked,
                                           const std::uint32_t* table) {
  // Row slot r's scale pairs for the block's first and second 16 K (MXFP4: one for both).
  std::uint32_t sp[4][2];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int byte = kMx ? r : 2 * r + h;
      const std::uint32_t word = byte < 4 ? f.scale.x : f.scale.y;
      sp[r][h] = table[(word >> (8 * (byte % 4))) & 0xFFu];
    }
  }
#pragma unroll
  for (int q = 0; q < dl::kChunks; ++q) {
    uint4 x[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) x[mt] = packed_acts(rows[mt], k0, q, k, checked);
#pragma unroll
    for (int s2 = 0; s2 < 2; ++s2) {
      const int h = (2 * q + s2) / 4;  // the step's scale group
#pragma unroll
      for (int rt = 0; rt < 2; ++rt) {
        std::uint32_t w = word_of(f.chunk[q], 2 * s2 + rt);
        ptx::pin(w);  // dequantized after the previous MMA, not all hoisted to the top
        std::uint32_t r[4];
        packed_fields(w, r);
        std::uint32_t a[4];
        a[0] = num::bf16x2_mul(r[0], sp[2 * rt][h]);
        a[1] = num::bf16x2_mul(r[1], sp[2 * rt + 1][h]);
        a[2] = num::bf16x2_mul(r[2], sp[2 * rt][h]);
        a[3] = num::bf16x2_mul(r[3], sp[2 * rt + 1][h]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ptx::mma_bf16_16816(acc[rt][mt], a, word_of(x[mt], 2 * s2), word_of(x[mt], 2 * s2 + 1));
        }
      }
    }
  }
}

// Rows m0 .. m0 + 8 MT - 1 of the block's 32 columns over the K blocks [kb_begin, kb_end) of
// tile `tile`; K block kb_end - 1 is partial when k_end is not a multiple of 128.
template <int MT, bool kMx>
__device__ void packed_rows(const GemmParams& p, std::int64_t tile, std::int64_t m0,
                            std::int64_t kb_begin, std::int64_t kb_end, std::int64_t k_end,
                            float fold, float (*red)[tl::kDecodeNTile][tl::kDecodeMaxM],
                            const std::uint32_t* table) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const std::int64_t kb_count = dl::k_blocks(p.k);
  const int per = dl::scale_bytes_per_lane(kMx);
  // This lane's bytes of K block kb: codes and scale codes advance by a whole tile-block per K
  // block, so the loop moves two pointers by constants.
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes) +
                      (tile * kb_count + kb_begin + warp) * dl::kTileBlockBytes +
                      lane * dl::kChunkBytes;
  const auto* scales = reinterpret_cast<const std::uint8_t*>(p.scales) + dl::kTableBytes +
                       (tile * kb_count + kb_begin + warp) * dl::kLanes * per + lane * per;
  constexpr std::int64_t kStep = tl::kDecodeWarps;  // K blocks between a warp's turns
  const std::int64_t code_step = kStep * dl::kTileBlockBytes, scale_step = kStep * dl::kLanes * per;
  const std::uint16_t* rows[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const std::int64_t m = m0 + 8 * mt + g;
    rows[mt] = reinterpret_cast<const std::uint16_t*>(p.a) + (m < p.m ? m : p.m - 1) * p.k;
  }
  // Whole K blocks run unchecked; a partial last block (K not a multiple of 128) after them.
  const std::int64_t kb_full = k_end % dl::kBlockK == 0 ? kb_end : kb_end - 1;
  float acc[2][MT][4] = {};
  std::int64_t kb = kb_begin + warp;
  // Register sets in rotation: while one K block multiplies, three are in flight from HBM
  // (2 KiB a set and warp: 6 KiB a warp, 48 KiB an SM at one 256-thread block). The sets trade
  // roles by constant index in the unrolled body: a register copy would wait for the load it
  // copies. Four sets cost no instruction per weight over three (the SASS budget test) and 20
  // registers (210).
  constexpr int kSets = 4;
  PackedBlock set[kSets];
  const auto load = [&](PackedBlock& into, std::int64_t ahead) {
    if (kb + ahead * kStep < kb_full) {
      packed_load<kMx>(into, codes + ahead * code_step, scales + ahead * scale_step);
    }
  };
  const auto step = [&](const PackedBlock& ready) {
    packed_mma<MT, kMx>(acc, ready, rows, kb * dl::kBlockK + 32 * t, p.k, false, table);
    kb += kStep;
    codes += code_step;
    scales += scale_step;
  };
  load(set[0], 0);
  load(set[1], 1);
  load(set[2], 2);
#pragma unroll 1
  while (kb < kb_full) {
    load(set[3], 3);
    step(set[0]);
    if (kb >= kb_full) break;
    load(set[0], 3);
    step(set[1]);
    if (kb >= kb_full) break;
    load(set[1], 3);
    step(set[2]);
    if (kb >= kb_full) break;
    load(set[2], 3);
    step(set[3]);
  }
  if (kb_full < kb_end && kb == kb_full) {  // this warp's turn falls on the partial block
    packed_load<kMx>(set[0], codes, scales);
    packed_mma<MT, kMx>(acc, set[0], rows, kb * dl::kBlockK + 32 * t, p.k, true, table);
  }
  // The weights were multiplied by 2^-fold: the fold, an exact power of two, comes back here.
  store_decode_rows<MT>(p, acc, tile * dl::kTileN, m0, fold, red);
}

template <bool kMx>
__device__ void packed_block_of(const GemmParams& p,
                                float (*red)[tl::kDecodeNTile][tl::kDecodeMaxM],
                                const std::uint32_t* table) {
  const std::int64_t tile = blockIdx.x;
  std::int64_t k_begin = 0, k_end = p.k;
  if (p.splits > 1) tl::split_k_range(p.k, p.k_per_split, blockIdx.z, &k_begin, &k_end);
  // Slices start on K blocks (k_per_split is a multiple of the split unit).
  const std::int64_t kb_begin = k_begin / dl::kBlockK;
  const std::int64_t kb_end = (k_end + dl::kBlockK - 1) / dl::kBlockK;
  const float fold = ldexpf(1.0f, p.weight_fold);
  // M beyond 16 repeats the weights once per 16 rows.
  for (std::int64_t m0 = 0; m0 < p.m; m0 += tl::kDecodeMaxM) {
    if (p.m - m0 <= 8) {
      packed_rows<1, kMx>(p, tile, m0, kb_begin, kb_end, k_end, fold, red, table);
    } else {
      packed_rows<2, kMx>(p, tile, m0, kb_begin, kb_end, k_end, fold, red, table);
    }
  }
}

__device__ void decode_packed_block(const GemmParams& p) {
  __shared__ float red[tl::kDecodeWarps][tl::kDecodeNTile][tl::kDecodeMaxM];
  static_assert(tl::kDecodeThreads == dl::kTableEntries, "one table entry a thread");
  __shared__ std::uint32_t table[dl::kTableEntries];
  table[threadIdx.x] = __ldg(reinterpret_cast<const unsigned*>(p.scales) + threadIdx.x);
  __syncthreads();
  if (p.flags & kGemmMxfp4) {
    packed_block_of<true>(p, red, table);
  } else {
    packed_block_of<false>(p, red, table);
  }
}

}  // namespace metrale::kernels
