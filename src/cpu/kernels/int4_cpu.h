// The w4a16 module's CPU kernels for INT4 weights (kGemmInt4; Note [INT4 weights]): one kernel
// for the decode and tiled entries, by instruction set. Internal to src/cpu/kernels.
#pragma once

#include <cstdint>

#include "cpu/kernels/w4a16_cpu.h"
#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16 {

// C[:, n0:n1] for every row of p, INT4 weights, the decode route: on AVX-512 BF16 the weights are
// streamed once per 16 rows of A (int4_bf16.cpp), on AVX2 (and AVX-512 without BF16) once per 4
// (int4_avx2.cpp), elsewhere by the portable kernel. Weights in the panel layout (kGemmPanels):
// int4_panels.cpp on AVX-512 BF16, else the portable kernel.
void int4_gemm(const GemmParams& p, std::int64_t n0, std::int64_t n1, Isa isa);
// The same for the tiled route: on AVX-512 BF16 register tiles over panels decoded once per block
// (int4_tiled.cpp), on AVX2 the decode kernel's slices of 4 rows, elsewhere the portable kernel.
// Weights in the panel layout: on AVX-512 BF16 int4_panels.cpp up to kInt4PanelsTiledMaxM rows,
// int4_tiled.cpp's panels past it; else the portable kernel.
void int4_tiled(const GemmParams& p, std::int64_t n0, std::int64_t n1, Isa isa);

namespace detail {
// The portable kernel: per group, Σ a·(code − zero) in FP32 (exact products), times the scale;
// codes in either layout.
void int4_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1);
// C[:, n0:n1] for p.m <= MB rows, MB in {1, 2, 4, 8, 16}; the caller has checked the processor.
template <int MB>
void int4_rows_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1);
// C[:, n0:n1] for p.m <= MB rows, MB in {1, 2, 4}, on AVX2 and FMA (int4_avx2.cpp); the caller
// has checked the processor.
template <int MB>
void int4_rows_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1);
// C[:, n0:n1] by the tiled kernel (int4_tiled.cpp), weights in the source or the panel layout
// (kGemmPanels; n0 a multiple of 32); the caller has checked the processor.
void int4_tiled_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1);
// C[:, n0:n1] for weights in the panel layout (n0 a multiple of 32) by register tiles that decode
// the lines themselves (int4_panels.cpp); the caller has checked the processor.
void int4_panels_bf16(const GemmParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace detail

}  // namespace metrale::cpu::w4a16
