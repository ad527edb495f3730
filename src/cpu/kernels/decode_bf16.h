// The decode kernel for processors with AVX-512 BF16 (decode_bf16.cpp). Internal to
// src/cpu/kernels.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16::detail {

// C[:, n0:n1] for row-major weights and p.m <= MB rows of A, MB in {1, 2, 4, 8, 16}; the caller
// has checked that the processor has AVX-512 BF16.
template <int MB>
void decode_rows_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::w4a16::detail
