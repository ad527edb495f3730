// gemm_e4m3_block128_avx512bf16: dense_e4m3_vector.h compiled for AVX-512 BF16, the codes
// widened by exponent arithmetic.
#define METRALE_E4M3_VBMI 0
#include "cpu/kernels/dense_e4m3_vector.h"

#include "cpu/kernels/dense_e4m3.h"

namespace metrale::cpu::blas {

void gemm_e4m3_block128_avx512bf16(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  avx512bf16::gemm(p, n0, n1);
}

void gemm_e4m3_block128_panels_avx512bf16(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  avx512bf16::gemm_panels(p, n0, n1);
}

}  // namespace metrale::cpu::blas
