// The argument block of the CPU backend's dense GEMM kernels (module "blas"): the buffers and
// shape of one Backend::run_dense_gemm, passed by value as one kernel parameter. Plain data.
#pragma once

#include <cstdint>

namespace metrale {

struct DenseParams {
  std::uint64_t a = 0, b = 0, c = 0;  // A [M, K], B [N, K], C [M, N] BF16 (FP32: out_f32)
  std::uint64_t bias = 0;             // BF16 [N], or 0
  std::uint64_t a_scales = 0;         // kE4m3Block128: FP32 [ceil(K/128), dense_a_scales_ld(M)]
  std::uint64_t b_scales = 0;         // kE4m3Block128: FP32 [ceil(N/128), dense_b_scales_ld(K)]
  std::int64_t m = 0, n = 0, k = 0;
  std::uint32_t out_f32 = 0;  // non-zero: C is FP32, the sum not rounded (DenseGemmShape)
};

}  // namespace metrale
