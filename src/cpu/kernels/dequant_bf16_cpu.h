// The CPU twin of the GPU's dequant_bf16 (cuda/kernels/dequant_bf16.cuh): the same units, the same
// values from the same code (kernels/dequant_bf16.h).
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16 {

// Units [u0, u1) of 32 weights each (dequant::unit_count): BF16 W [N, K] row-major into p.out from
// p.codes, p.scales, p.tensor_scale and p.flags (format and source layout).
void dequant_bf16(const GemmParams& p, std::int64_t u0, std::int64_t u1);

}  // namespace metrale::cpu::w4a16
