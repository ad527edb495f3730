// The decode route on processors with AVX2, FMA and F16C but no AVX-512 BF16 (decode_avx2.cpp).
// Internal to src/cpu/kernels.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16::detail {

// Rows of A one call of decode_rows_avx2 takes at most; more rows run in slices of this many.
inline constexpr int kAvx2DecodeMaxRows = 4;

// C[:, n0:n1] for row-major weights and p.m <= MB rows of A, MB in {1, 2, 4}; the caller has
// checked that the processor has AVX2, FMA and F16C.
template <int MB>
void decode_rows_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::w4a16::detail
