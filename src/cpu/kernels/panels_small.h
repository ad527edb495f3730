// The small-M kernels over weights in the panel layout (kernels/panel_layout.h, kGemmPanels):
// the decode route's for the panel layout, and the portable path every route takes below AVX-512
// BF16. Internal to src/cpu/kernels. See Note [CPU panel layout].
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16::detail {

// C[:, n0:n1] for every row of p, n0 a multiple of 32; the caller has checked that the
// processor has AVX-512 BF16.
void panels_small_avx512bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1);

// The same on any processor, one weight at a time: the reference the vector kernels are held
// to, and the path when the processor lacks AVX-512 BF16 (or it is capped below it).
void panels_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::w4a16::detail
