// The CPU backend's BF16 dense GEMM (DenseKind::kBf16): exact BF16 products, FP32 accumulation,
// the bias added in FP32, one rounding to BF16.
#pragma once

#include <cstdint>

#include "kernels/dense_params.h"

namespace metrale::cpu::blas {

// C[:, n0:n1] of p.
void gemm_bf16(const DenseParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::blas
