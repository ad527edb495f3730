// The CPU twins of the CUDA kernels gemm_int4_decode and dequant_int4_bf16: the same results from
// weights in the INT4 decode layout (kernels/int4_decode_layout.h, packed by ops/int4_pack.h),
// each weight read by the layout's own functions. The CPU's reference for that layout, not its
// fast path (its INT4 kernels read the source and the panel layout: int4_cpu.h).
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16 {

// C[:, n0:n1] = sum_j A[m, j] x w(n, j) (+ bias[n]), FP32 sums, w = (q - z) x scale exact
// (int4_decode::weight); under act order A is already in the stored order (permute_a_int4).
// Split-K fields are ignored: it writes C itself.
void gemm_int4_decode(const GemmParams& p, std::int64_t n0, std::int64_t n1);

// Units [u0, u1) of 8 weights each (dequant_int4::unit_count): BF16 W [N, K] into p.out.
void dequant_int4_bf16(const GemmParams& p, std::int64_t u0, std::int64_t u1);

}  // namespace metrale::cpu::w4a16
