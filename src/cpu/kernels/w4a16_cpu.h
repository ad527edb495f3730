// The CPU bodies of the w4a16 module's kernels. Each works on one grid block: a tile of output
// columns [n0, n1). Vectorized variants are chosen at run time from what the processor offers
// (AVX-512, AVX2, or portable code); never from how the binary was built.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16 {

// Instruction sets the kernels can use, best first (kAvx512Bf16 adds AVX512-BF16).
enum class Isa { kAvx512Bf16, kAvx512, kAvx2, kPortable };
// The best set this processor supports (METRALE_CPU_ISA=avx512|avx2|portable lowers it, for
// tests and benchmarks).
Isa best_isa() noexcept;
// best lowered to the set cap names ("avx512", "avx2", "portable"; null or "" leaves best); any
// other cap is named in a warning with the accepted values and ignored. best_isa()'s policy.
Isa capped_isa(Isa best, const char* cap);
// "avx512_bf16", "avx512", "avx2", "portable".
const char* to_string(Isa isa) noexcept;

// C[:, n0:n1] for the decode route (weights streamed once per block, M rows reuse each load).
void gemm_decode(const GemmParams& p, std::int64_t n0, std::int64_t n1, Isa isa);
// C[m0:m1, n0:n1] for the tiled route: register tiles over 32 columns and several rows, the
// weights decoded once per panel for every row tile (or, on the panel layout up to 96 rows,
// by each row tile itself; panels_tiled.h).
void gemm_tiled(const GemmParams& p, std::int64_t n0, std::int64_t n1, std::int64_t m0,
                std::int64_t m1, Isa isa);
// C[:, n0:n1] for the E4M3 route: E4M3 A and W, exact products, FP32 sums per K-group, FP32
// group scales.
void gemm_e4m3(const GemmParams& p, std::int64_t n0, std::int64_t n1);

// Outputs [i0, i1) of C (flat over M x N): the split-K partials summed in slice order, then the
// tensor scale, bias and one rounding to BF16, as the GPU's gemm_split_reduce.
void split_reduce(const GemmParams& p, std::int64_t i0, std::int64_t i1);
// out[i] = e4m3(in[i]) for i in [i0, i1).
void cast_bf16_to_e4m3(const CastParams& p, std::int64_t i0, std::int64_t i1);
// Rows [r0, r1) of the E4M3 copy [N, K] of packed E2M1 weights (codes only; scales unchanged).
void dequant_e4m3(const CastParams& p, std::int64_t r0, std::int64_t r1);

}  // namespace metrale::cpu::w4a16
