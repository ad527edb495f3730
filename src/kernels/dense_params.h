// The argument block of the CPU backend's dense GEMM kernels (module "blas"): the buffers and
// shape of one Backend::run_dense_gemm, passed by value as one kernel parameter. Plain data.
#pragma once

#include <cstdint>

#include "metrale/dense_gemm.h"

namespace metrale {

struct DenseParams {
  std::uint64_t a = 0, b = 0, c = 0;  // A [M, K], B [N, K], C [M, N] BF16 (FP32: out_f32)
  std::uint64_t bias = 0;             // BF16 [N], or 0
  std::uint64_t a_scales = 0;         // kE4m3Block128: FP32 [ceil(K/128), dense_a_scales_ld(M)]
  std::uint64_t b_scales = 0;         // kE4m3Block128: FP32 [ceil(N/128), dense_b_scales_ld(K)]
  std::int64_t m = 0, n = 0, k = 0;
  std::uint32_t out_f32 = 0;  // non-zero: C is FP32, the sum not rounded (DenseGemmShape)
  // A's scales' leading dimension; 0 means dense_a_scales_ld(m). A grouped GEMM's expert reads
  // its rows' scales out of the whole cast A's, whose leading dimension is the row capacity's.
  std::int64_t a_scales_ld = 0;
};

// The leading dimension p's kernel reads A's scales with.
constexpr std::int64_t a_scales_ld(const DenseParams& p) noexcept {
  return p.a_scales_ld != 0 ? p.a_scales_ld : dense_a_scales_ld(p.m);
}

}  // namespace metrale
