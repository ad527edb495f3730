// Writing C (or split-K partials) from the w4a16 kernels' FP32 sums: tensor scale, bias, then
// one rounding to BF16 (or FP32 as it is, with kGemmOutF32); one store where two outputs share
// aligned bytes. Device code only.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"

namespace metrale::kernels {

namespace num = metrale::num;

// Output column n's final value from its FP32 sum: tensor scale, then bias, in FP32.
__device__ __forceinline__ float final_f32(const GemmParams& p, std::int64_t n, float sum) {
  float v = sum * p.tensor_scale;
  if (p.flags & kGemmBias) v += num::bf16_to_f32(reinterpret_cast<const std::uint16_t*>(p.bias)[n]);
  return v;
}

// Output column n's final BF16 from its FP32 sum: tensor scale, bias, one rounding.
__device__ __forceinline__ std::uint32_t final_bf16(const GemmParams& p, std::int64_t n,
                                                    float sum) {
  return num::f32_to_bf16(final_f32(p, n, sum));
}

// C element `at` (column n) from its FP32 sum: FP32 as it is where the plan asked for FP32 C
// (kGemmOutF32, the row-parallel partials the ranks sum), else rounded once to BF16.
__device__ __forceinline__ void write_final(const GemmParams& p, std::int64_t at, std::int64_t n,
                                            float sum) {
  if (p.flags & kGemmOutF32) {
    reinterpret_cast<float*>(p.out)[at] = final_f32(p, n, sum);
  } else {
    reinterpret_cast<std::uint16_t*>(p.out)[at] = static_cast<std::uint16_t>(final_bf16(p, n, sum));
  }
}

// Writes one output: its final value or, when K is split, the FP32 partial.
__device__ __forceinline__ void store_output(const GemmParams& p, std::int64_t m, std::int64_t n,
                                             float sum) {
  if (p.splits > 1) {
    reinterpret_cast<float*>(p.workspace)[(blockIdx.z * p.m + m) * p.n + n] = sum;
    return;
  }
  write_final(p, m * p.n + n, n, sum);
}

// Outputs (m, n) and (m, n + 1) of a fragment's column pair: one 4-byte store (8 bytes for FP32
// C) where both lie in C and the pair is so aligned (not split-K partials: those go through
// store_output).
__device__ __forceinline__ void store_pair(const GemmParams& p, std::int64_t m, std::int64_t n,
                                           float v0, float v1) {
  if (m >= p.m || n >= p.n) return;
  const std::int64_t at = m * p.n + n;
  if (n + 1 >= p.n || (at & 1) != 0 || p.splits > 1) {
    store_output(p, m, n, v0);
    if (n + 1 < p.n) store_output(p, m, n + 1, v1);
    return;
  }
  if (p.flags & kGemmOutF32) {
    reinterpret_cast<float2*>(p.out)[at / 2] =
        make_float2(final_f32(p, n, v0), final_f32(p, n + 1, v1));
    return;
  }
  reinterpret_cast<std::uint32_t*>(p.out)[at / 2] = final_bf16(p, n, v0) | final_bf16(p, n + 1, v1)
                                                                               << 16;
}

// A warpgroup's m64nN accumulator (Regs = N / 2 registers, as wgmma leaves them) into C rows from
// m0 and columns from n0: columns 2t, 2t + 1 of each 8-wide slice are one register pair, so one
// packed store each.
template <int Regs>
__device__ __forceinline__ void store_wgmma_acc(const GemmParams& p, const float (&acc)[Regs],
                                                std::int64_t m0, std::int64_t n0, int wtid) {
#pragma unroll
  for (int i = 0; i < Regs; i += 2) {
    store_pair(p, m0 + tiles::wgmma_acc_row(wtid, i), n0 + tiles::wgmma_acc_col(wtid, i), acc[i],
               acc[i + 1]);
  }
}

}  // namespace metrale::kernels
