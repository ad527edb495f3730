// The INT4 decode GEMM (small M) on weights in the INT4 decode layout
// (kernels/int4_decode_layout.h), sm_80 and later. The grid and the sums are gemm_decode_packed's
// (decode_packed.cuh): C^T = W · A^T on m16n8k16 tensor cores, a block per 32 output columns, its
// 8 warps on interleaved 128-K blocks summed in shared memory in warp order, grid z over K slices.
// What differs is the weight: a word's nibbles become BF16 128 + q by exponent bias (a mask under
// 0x4300; the shifts ride the FMA pipe as multiplies), one BF16 subtraction of 128 + z leaves
// q - z exactly, and the group scale multiplies each 32-K span's FP32 sum (or each K block's, for
// groups of 128 and more), never a weight: no weight is rounded. Act order reads A through the
// permutation applied to A by the launch before (permute_a_int4).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "decode_reduce.cuh"
#include "epilogue.cuh"
#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"
#include "operands.cuh"
#include "ptx.cuh"

namespace metrale::kernels {

namespace i4 = metrale::int4_decode;

// One K block of a lane's weights: four 16-byte chunks of codes, its 4 rows' scales (kE entries
// each, 2 bytes) and zero points (1 byte).
template <int kE>
struct Int4Block {
  uint4 chunk[decode_layout::kChunks];
  std::uint32_t scale[2 * kE];
  std::uint32_t zero[kE];
};

// `side`: the tile block's side bytes; the lane's scales are 8 kE bytes at 8 kE g, its zero
// points 4 kE bytes at 64 kE + 4 kE g (int4_decode::side_slot).
template <int kE>
__device__ __forceinline__ void int4_load(Int4Block<kE>& f, const std::uint8_t* codes,
                                          const std::uint8_t* side, int g) {
  namespace dl = metrale::decode_layout;
#pragma unroll
  for (int q = 0; q < dl::kChunks; ++q)
    f.chunk[q] = ptx::ldg16(codes + q * dl::kLanes * dl::kChunkBytes);
  if constexpr (kE == 1) {
    const uint2 s = ptx::ldg8(side + 8 * g);
    f.scale[0] = s.x;
    f.scale[1] = s.y;
    f.zero[0] = __ldg(reinterpret_cast<const unsigned*>(side + 64 + 4 * g));
  } else {
    static_assert(kE == 4, "one entry per K block or per 32-K span");
    const uint4 s0 = ptx::ldg16(side + 32 * g), s1 = ptx::ldg16(side + 32 * g + 16);
    const uint4 z = ptx::ldg16(side + 256 + 16 * g);
    f.scale[0] = s0.x;
    f.scale[1] = s0.y;
    f.scale[2] = s0.z;
    f.scale[3] = s0.w;
    f.scale[4] = s1.x;
    f.scale[5] = s1.y;
    f.scale[6] = s1.z;
    f.scale[7] = s1.w;
    f.zero[0] = z.x;
    f.zero[1] = z.y;
    f.zero[2] = z.z;
    f.zero[3] = z.w;
  }
}

// (w >> kShift) & mask under the exponent bias: the shift as the high half of a multiply by
// 2^(32 - kShift) (FMA pipe), the mask and the bias one LOP3.
template <int kShift>
__device__ __forceinline__ std::uint32_t int4_fields(std::uint32_t w) {
  std::uint32_t shifted = w;
  if constexpr (kShift != 0) {
    std::uint32_t lo;
    ptx::mul_wide_u32<(1u << (32 - kShift))>(w, lo, shifted);
  }
  return ptx::and_or<i4::kNibbleMask, i4::kBias>(shifted);
}

// Lane (g, t)'s activations for chunk q: 8 BF16 of row `row` from column at = k0 + 32 q, zero
// past K where `checked` (K is a multiple of 32: a chunk lies wholly inside or outside). Under act
// order A arrives permuted already (permute_a_int4 ran before).
__device__ __forceinline__ uint4 int4_acts(const std::uint16_t* row, std::int64_t at,
                                           std::int64_t k, bool checked) {
  if (checked && at >= k) return make_uint4(0, 0, 0, 0);
  return ptx::ldg16(row + at);
}

// Entry e of row slot r: its scale as a float and its zero pair (128 + z twice).
template <int kE, bool kFp16>
__device__ __forceinline__ float int4_scale(const Int4Block<kE>& f, int r, int e) {
  const int i = r * kE + e;
  const auto bits = static_cast<std::uint16_t>(f.scale[i / 2] >> (16 * (i % 2)));
  if constexpr (kFp16) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(bits));  // one HADD2.F32
#else
    return num::f16_to_f32(bits);
#endif
  } else {
    return num::bf16_to_f32(bits);
  }
}
// The zero pair from the zero point's byte (0..15) with one PRMT: bytes z, 0x43, z, 0x43.
template <int kE>
__device__ __forceinline__ std::uint32_t int4_zero_pair(const Int4Block<kE>& f, int r, int e) {
  const int i = r * kE + e, b = i % 4;
  return ptx::prmt<0x43u>(f.zero[i / 4], static_cast<std::uint32_t>(b | 4 << 4 | b << 8 | 4 << 12));
}

// The 8 MMA steps of one K block into acc[row tile][activation tile]: each span of 4 / kE chunks
// (one scale entry) sums into `part` from zero, then acc += scale x part per row.
template <int MT, int kE, bool kFp16>
__device__ __forceinline__ void int4_mma(float (&acc)[2][MT][4], const Int4Block<kE>& f,
                                         const std::uint16_t* const (&rows)[MT], std::int64_t k0,
                                         std::int64_t k, bool checked) {
  constexpr int kSpanChunks = 4 / kE;
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    std::uint32_t zp[4];
    float s[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      zp[r] = int4_zero_pair(f, r, e);
      s[r] = int4_scale<kE, kFp16>(f, r, e);
    }
    float part[2][MT][4] = {};
#pragma unroll
    for (int c = 0; c < kSpanChunks; ++c) {
      const int q = e * kSpanChunks + c;
      uint4 x[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) x[mt] = int4_acts(rows[mt], k0 + 32 * q, k, checked);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int rt = 0; rt < 2; ++rt) {
          std::uint32_t w = word_of(f.chunk[q], 2 * h + rt);
          ptx::pin(w);  // dequantized after the previous MMA, not all hoisted to the top
          std::uint32_t a[4];
          a[0] = num::bf16x2_sub(int4_fields<0>(w), zp[2 * rt]);
          a[1] = num::bf16x2_sub(int4_fields<4>(w), zp[2 * rt + 1]);
          a[2] = num::bf16x2_sub(int4_fields<8>(w), zp[2 * rt]);
          a[3] = num::bf16x2_sub(int4_fields<12>(w), zp[2 * rt + 1]);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            ptx::mma_bf16_16816(part[rt][mt], a, word_of(x[mt], 2 * h), word_of(x[mt], 2 * h + 1));
          }
        }
      }
    }
    // Accumulator registers 0, 1 are row g of the row tile (slot 2 rt), 2, 3 row g + 8.
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][mt][i] += s[2 * rt + i / 2] * part[rt][mt][i];
      }
    }
  }
}

// Rows m0 .. m0 + 8 MT - 1 of the block's 32 columns over the K blocks [kb_begin, kb_end) of
// tile `tile`; K block kb_end - 1 is partial when k_end is not a multiple of 128.
template <int MT, int kE, bool kFp16>
__device__ __forceinline__ void int4_rows(const GemmParams& p, std::int64_t tile, std::int64_t m0,
                                          std::int64_t kb_begin, std::int64_t kb_end,
                                          std::int64_t k_end,
                                          float (*red)[tiles::kDecodeNTile][tiles::kDecodeMaxM]) {
  namespace dl = metrale::decode_layout;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const std::int64_t kb_count = dl::k_blocks(p.k);
  const std::int64_t side_block = i4::side_block_bytes(kE);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes) +
                      (tile * kb_count + kb_begin + warp) * dl::kTileBlockBytes +
                      lane * dl::kChunkBytes;
  const auto* side = reinterpret_cast<const std::uint8_t*>(p.scales) +
                     (tile * kb_count + kb_begin + warp) * side_block;
  constexpr std::int64_t kStep = tiles::kDecodeWarps;
  const std::int64_t code_step = kStep * dl::kTileBlockBytes, side_step = kStep * side_block;
  const std::uint16_t* rows[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const std::int64_t m = m0 + 8 * mt + g;
    rows[mt] = reinterpret_cast<const std::uint16_t*>(p.a) + (m < p.m ? m : p.m - 1) * p.k;
  }
  const std::int64_t kb_full = k_end % dl::kBlockK == 0 ? kb_end : kb_end - 1;
  float acc[2][MT][4] = {};
  std::int64_t kb = kb_begin + warp;
  // Register sets in rotation, as gemm_decode_packed's: while one K block multiplies, the others
  // are in flight. Four sets of 12 words with a scale per K block; three of 28 with a scale per
  // 32-K span, whose fourth set would spill on sm_80 and sm_89 (255 registers).
  constexpr int kSets = kE == 4 ? 3 : 4;
  Int4Block<kE> set[kSets];
  const auto load = [&](Int4Block<kE>& into, std::int64_t ahead) {
    if (kb + ahead * kStep < kb_full) {
      int4_load<kE>(into, codes + ahead * code_step, side + ahead * side_step, g);
    }
  };
  const auto step = [&](const Int4Block<kE>& ready) {
    int4_mma<MT, kE, kFp16>(acc, ready, rows, kb * dl::kBlockK + 8 * t, p.k, false);
    kb += kStep;
    codes += code_step;
    side += side_step;
  };
#pragma unroll
  for (int i = 0; i + 1 < kSets; ++i) load(set[i], i);
#pragma unroll 1
  while (kb < kb_full) {
    // The sets trade roles by constant index: a register copy would wait for the load it copies.
#pragma unroll
    for (int i = 0; i < kSets; ++i) {
      load(set[(i + kSets - 1) % kSets], kSets - 1);
      step(set[i]);
      if (kb >= kb_full) break;
    }
  }
  if (kb_full < kb_end && kb == kb_full) {  // this warp's turn falls on the partial block
    int4_load<kE>(set[0], codes, side, g);
    int4_mma<MT, kE, kFp16>(acc, set[0], rows, kb * dl::kBlockK + 8 * t, p.k, true);
  }
  store_decode_rows<MT>(p, acc, tile * dl::kTileN, m0, 1.0f, red);
}

template <int kE, bool kFp16>
__device__ __forceinline__ void int4_block_of(
    const GemmParams& p, float (*red)[tiles::kDecodeNTile][tiles::kDecodeMaxM]) {
  namespace dl = metrale::decode_layout;
  const std::int64_t tile = blockIdx.x;
  std::int64_t k_begin = 0, k_end = p.k;
  if (p.splits > 1) tiles::split_k_range(p.k, p.k_per_split, blockIdx.z, &k_begin, &k_end);
  const std::int64_t kb_begin = k_begin / dl::kBlockK;
  const std::int64_t kb_end = (k_end + dl::kBlockK - 1) / dl::kBlockK;
  for (std::int64_t m0 = 0; m0 < p.m; m0 += tiles::kDecodeMaxM) {
    if (p.m - m0 <= 8) {
      int4_rows<1, kE, kFp16>(p, tile, m0, kb_begin, kb_end, k_end, red);
    } else {
      int4_rows<2, kE, kFp16>(p, tile, m0, kb_begin, kb_end, k_end, red);
    }
  }
}

__device__ __forceinline__ void decode_int4_block(const GemmParams& p) {
  __shared__ float red[tiles::kDecodeWarps][tiles::kDecodeNTile][tiles::kDecodeMaxM];
  const bool fp16 = p.flags & kGemmFp16Scales;
  if (i4::entries(p.group) == 1) {
    fp16 ? int4_block_of<1, true>(p, red) : int4_block_of<1, false>(p, red);
  } else {
    fp16 ? int4_block_of<4, true>(p, red) : int4_block_of<4, false>(p, red);
  }
}

}  // namespace metrale::kernels
