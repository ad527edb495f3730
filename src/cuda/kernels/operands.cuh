// The weight operand helpers that every NVFP4/MXFP4 GEMM kernel here shares (decode, tiled,
// e4m3): where a block scale sits, the checked and unchecked loads of a run of 32 codes and of
// its raw scale codes, the block's table of scales as BF16 pairs, and the exact dequantization
// of four codes by their scale pair.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "ptx.cuh"

namespace metrale::kernels {

namespace num = metrale::num;

// 32 codes of weight row n from k0 (a multiple of 32), of which `valid` (0, 16 or 32) lie in K;
// the rest read as code 0. The layout is a template parameter so that the row-major loop
// carries none of the transposed path's byte loads (registers and instructions).
template <bool kTr>
__device__ __forceinline__ uint4 load_codes(const GemmParams& p, std::int64_t n, std::int64_t k0,
                                            int valid) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (n >= p.n || valid == 0) return v;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes);
  if constexpr (kTr) {
    // Codes [K/2, N]: a byte per row of the packed matrix. Correct, not tuned. Unrolled with
    // constant indices so the words stay in registers (an indexed array would live in local
    // memory).
    std::uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (2 * i < valid) w[i / 4] |= std::uint32_t{codes[(k0 / 2 + i) * p.n + n]} << (8 * (i % 4));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  const std::uint8_t* src = codes + n * (p.k / 2) + k0 / 2;
  // A row is K/2 bytes, a multiple of 8; a 16-byte load needs rows of a multiple of 16.
  if (valid == 32 && (p.k / 2) % 16 == 0) return ptx::ldg16(src);
  const uint2 lo = ptx::ldg8(src);
  v.x = lo.x;
  v.y = lo.y;
  if (valid == 32) {
    const uint2 hi = ptx::ldg8(src + 8);
    v.z = hi.x;
    v.w = hi.y;
  }
  return v;
}

// Where the block scale of row n, group g sits, in either layout.
__device__ __forceinline__ std::int64_t scale_index(const GemmParams& p, std::int64_t n,
                                                    std::int64_t g, bool tr) {
  const bool mx = p.flags & kGemmMxfp4;
  const std::int64_t groups = p.k / (mx ? num::kMxfp4Group : num::kNvfp4Group);
  return tr ? g * p.n + n : n * groups + g;
}
__device__ __forceinline__ std::int64_t scale_index(const GemmParams& p, std::int64_t n,
                                                    std::int64_t g) {
  return scale_index(p, n, g, p.flags & kGemmTransposed);
}

// The raw scale codes of row n for the 32 K from k0 (a multiple of 32), `valid` of them inside
// K: the first 16's in byte 0, the second 16's in byte 1 (MXFP4: byte 0 covers all 32); 0 where
// outside N or K (the codes there are 0 too, and code 0 is a finite scale in both formats, so
// nothing outside K can turn a sum into NaN). Predicated loads into a zeroed register: a select
// after a load would wait for it. The usual case, both NVFP4 scales in one aligned 16-bit load,
// takes no arithmetic, so nothing waits on the load until the scales are used.
template <bool kTr>
__device__ __forceinline__ std::uint32_t load_scales_raw(const GemmParams& p, std::int64_t n,
                                                         std::int64_t k0, int valid) {
  const bool mx = p.flags & kGemmMxfp4, tr = kTr;
  const auto* sc = reinterpret_cast<const std::uint8_t*>(p.scales);
  const std::int64_t g0 = mx ? k0 / 32 : k0 / 16;
  std::uint32_t v = 0;
  if (n < p.n && valid > 0) {
    const std::int64_t at = scale_index(p, n, g0, tr);
    if (mx || valid == 16) {
      v = sc[at];
    } else if (!tr && at % 2 == 0) {
      v = *reinterpret_cast<const std::uint16_t*>(sc + at);
    } else {
      v = sc[at] | std::uint32_t{sc[tr ? at + p.n : at + 1]} << 8;
    }
  }
  return v;
}

// A row-major run's raw scale codes with no checks (an interior run, K a multiple of 32): the
// NVFP4 pair in one aligned 16-bit load, the MXFP4 code in one byte; as load_scales_raw packs
// them.
__device__ __forceinline__ std::uint32_t ldg_scales_raw(const std::uint8_t* sc, bool mx) {
  return mx ? std::uint32_t{__ldg(sc)}
            : std::uint32_t{__ldg(reinterpret_cast<const unsigned short*>(sc))};
}

// Fills table[code] with every scale code's BF16 pair (s, s), one entry a thread of a 256-thread
// block, and waits for the whole table: the kernels read scales from it instead of converting
// (the conversion is exact, numerics.h).
__device__ __forceinline__ void fill_scale_pairs(const GemmParams& p, std::uint32_t* table) {
  const auto code = static_cast<std::uint8_t>(threadIdx.x);
  table[threadIdx.x] =
      num::bf16_pair_of((p.flags & kGemmMxfp4) ? num::e8m0_to_f32(code) : num::e4m3_to_f32(code));
  __syncthreads();
}

// Scale h (0: the first 16 K, 1: the second) of raw codes from load_scales_raw, as its table
// entry.
__device__ __forceinline__ std::uint32_t scale_pair_of_raw(const GemmParams& p,
                                                           const std::uint32_t* table,
                                                           std::uint32_t raw, int h) {
  const bool mx = p.flags & kGemmMxfp4;
  return table[(h && !mx ? raw >> 8 : raw) & 0xFFu];
}

// The number of lane t's 32 K from kb that lie before k_end: 0, 16 or 32 (K is a multiple of
// 16).
__device__ __forceinline__ int valid_k(std::int64_t kb, std::int64_t k_end, int t) {
  const std::int64_t left = k_end - (kb + 32 * t);
  return left >= 32 ? 32 : (left > 0 ? static_cast<int>(left) : 0);
}

// Word i of v, by selects: an index unknown at compile time into an array would put the array
// in local memory.
__device__ __forceinline__ std::uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Four E2M1 codes (16 bits) times a scale pair, as two BF16x2 words: codes 0, 1 into *r01 and
// 2, 3 into *r23 (an MMA A fragment's register pair in the decode kernel, a shared-memory store
// in the tiled one); exact products (numerics.h, host-tested).
__device__ __forceinline__ void dequant_quad(std::uint32_t codes16, std::uint32_t scale_pair,
                                             std::uint32_t* r01, std::uint32_t* r23) {
  std::uint32_t p01, p23;
  num::e2m1x4_to_bf16(codes16, &p01, &p23);
  *r01 = num::bf16x2_mul(p01, scale_pair);
  *r23 = num::bf16x2_mul(p23, scale_pair);
}

}  // namespace metrale::kernels
