// The tiled route's kernel over weights in the panel layout (kernels/panel_layout.h,
// kGemmPanels) on AVX-512 BF16. Internal to src/cpu/kernels. See Note [CPU panel layout].
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16::detail {

// C[:, n0:n1] for every row of p, n0 a multiple of 32; the caller has checked the processor.
// Exact for every scale code: each block's FP32 sum is scaled once.
void panels_tiled_avx512bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::w4a16::detail
