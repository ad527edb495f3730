// gemm_e4m3_block128_avx512vbmi: dense_e4m3_vector.h compiled for AVX-512 BF16 with VBMI, the
// codes widened by two byte lookups.
#define METRALE_E4M3_VBMI 1
#include "cpu/kernels/dense_e4m3_vector.h"

#include "cpu/kernels/dense_e4m3.h"

namespace metrale::cpu::blas {

void gemm_e4m3_block128_avx512vbmi(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  vbmi::gemm(p, n0, n1);
}

void gemm_e4m3_block128_panels_avx512vbmi(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  vbmi::gemm_panels(p, n0, n1);
}

bool has_avx512vbmi() noexcept {
  static const bool yes = __builtin_cpu_supports("avx512vbmi");
  return yes;
}

}  // namespace metrale::cpu::blas
