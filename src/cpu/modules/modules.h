// Factories of the CPU backend's built-in host modules.
#pragma once

#include "metrale/host_module.h"

namespace metrale::cpu {

// Module "core": element-wise kernels (fill_u32, axpy_f32) that publish their N tiles.
HostModule make_core_module();

// Module "w4a16": the quantized GEMM routes and the E4M3 casts (src/ops/gemm.cpp runs them).
HostModule make_w4a16_module();

// Module "blas": the dense GEMMs behind CpuBackend::run_dense_gemm, one kernel per DenseKind
// (gemm_bf16, gemm_e4m3_block128), each publishing its N tile.
HostModule make_blas_module();

// Module "fp8": the W8A8 op's activation cast to E4M3 with block scales (cast_e4m3_block128).
HostModule make_fp8_module();

// Module "moe": a mixture-of-experts layer's routing, permutation into expert order and combination
// back (src/ops/moe.cpp runs them).
HostModule make_moe_module();

}  // namespace metrale::cpu
