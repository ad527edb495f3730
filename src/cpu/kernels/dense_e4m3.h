// The CPU backend's block-scaled FP8 dense GEMM (DenseKind::kE4m3Block128), the reference the
// GPU's cuBLASLt route is held to: exact E4M3 products summed in FP32 per 128-K block (the K
// tail block shorter), each block sum times its A scale and its B scale, the blocks summed in
// FP32, the bias added, one rounding to BF16.
#pragma once

#include <cstdint>

#include "kernels/dense_params.h"

namespace metrale::cpu::blas {

// C[:, n0:n1] of p (A, B E4M3 codes; scales FP32 in dense_gemm.h's layouts).
void gemm_e4m3_block128(const DenseParams& p, std::int64_t n0, std::int64_t n1);
// The same on AVX-512 BF16 (dense_e4m3_avx512.cpp): the codes widened to BF16 in registers and
// multiplied by vdpbf16ps, the sums in another order. Call only where the processor has
// AVX512-BF16 (w4a16::best_isa() says kAvx512Bf16).
void gemm_e4m3_block128_avx512bf16(const DenseParams& p, std::int64_t n0, std::int64_t n1);
// The same with AVX512-VBMI's byte lookups widening the codes (dense_e4m3_vbmi.cpp): the sums in
// yet another order. Call only where has_avx512vbmi() and the processor has AVX512-BF16.
void gemm_e4m3_block128_avx512vbmi(const DenseParams& p, std::int64_t n0, std::int64_t n1);
// The same four with B in the CPU's panel layout of E4M3 weights (kernels/fp8_panel_layout.h; K a
// multiple of 16, n0 a multiple of 32), which the grouped W8A8 GEMM's experts take on the CPU
// (Note [E4M3 panels]): the reference reads each code where the layout puts it and sums as
// gemm_e4m3_block128; the vector kernels widen a pair of 32 columns with one load.
void gemm_e4m3_block128_panels(const DenseParams& p, std::int64_t n0, std::int64_t n1);
void gemm_e4m3_block128_panels_avx512bf16(const DenseParams& p, std::int64_t n0, std::int64_t n1);
void gemm_e4m3_block128_panels_avx512vbmi(const DenseParams& p, std::int64_t n0, std::int64_t n1);
void gemm_e4m3_block128_panels_best(const DenseParams& p, std::int64_t n0, std::int64_t n1);
// Whether the processor has AVX512-VBMI.
bool has_avx512vbmi() noexcept;
// C[:, n0:n1] of p by the best of the three this processor runs (METRALE_CPU_ISA caps it, as for
// w4a16): the kernel module "blas" and the grouped W8A8 GEMM both launch, so an expert's product
// is the dense one's bit for bit.
void gemm_e4m3_block128_best(const DenseParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::blas
