// Writing C (or split-K partials) from the w4a16 kernels' FP32 sums: tensor scale, bias, one
// rounding to BF16; packed where two outputs share 4 aligned bytes. Device code only.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"

namespace metrale::kernels {

namespace num = metrale::num;

// Output column n's final BF16 from its FP32 sum: tensor scale, bias, one rounding.
__device__ __forceinline__ std::uint32_t final_bf16(const GemmParams& p, std::int64_t n,
                                                    float sum) {
  float v = sum * p.tensor_scale;
  if (p.flags & kGemmBias) v += num::bf16_to_f32(reinterpret_cast<const std::uint16_t*>(p.bias)[n]);
  return num::f32_to_bf16(v);
}

// Writes one output: the final BF16 or, when K is split, the FP32 partial.
__device__ __forceinline__ void store_output(const GemmParams& p, std::int64_t m, std::int64_t n,
                                             float sum) {
  if (p.splits > 1) {
    reinterpret_cast<float*>(p.workspace)[(blockIdx.z * p.m + m) * p.n + n] = sum;
    return;
  }
  reinterpret_cast<std::uint16_t*>(p.out)[m * p.n + n] =
      static_cast<std::uint16_t>(final_bf16(p, n, sum));
}

// Outputs (m, n) and (m, n + 1) of a fragment's column pair: one 4-byte store where both lie in
// C and the pair is 4-byte aligned (not split-K partials: those go through store_output).
__device__ __forceinline__ void store_pair(const GemmParams& p, std::int64_t m, std::int64_t n,
                                           float v0, float v1) {
  if (m >= p.m || n >= p.n) return;
  const std::int64_t at = m * p.n + n;
  if (n + 1 >= p.n || (at & 1) != 0 || p.splits > 1) {
    store_output(p, m, n, v0);
    if (n + 1 < p.n) store_output(p, m, n + 1, v1);
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
