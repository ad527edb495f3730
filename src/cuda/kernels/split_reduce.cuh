// The split-K reduction: each K slice of a split GEMM (the decode route's grid z) writes FP32
// partials of C, and this sums them in slice order, so the result does not depend on timing.
#pragma once

#include <cstdint>

#include "epilogue.cuh"
#include "kernels/gemm_params.h"

namespace metrale::kernels {

// C = Σ_z partial[z] in slice order, then tensor scale, bias and one rounding to BF16 (none for
// FP32 C).
__device__ __forceinline__ void split_reduce(const GemmParams& p, std::int64_t i) {
  if (i >= p.m * p.n) return;
  const auto* ws = reinterpret_cast<const float*>(p.workspace);
  const std::int64_t plane = p.m * p.n;
  float sum = 0.0f;
  for (std::int64_t z = 0; z < p.splits; ++z) sum += ws[z * plane + i];
  write_final(p, i, i % p.n, sum);
}

// Column n of every row of p (one expert's GEMM, grouped_params.h): the grouped reduction's
// thread, one column so that a block's threads read and write consecutive addresses. An expert's
// rows are known on the device only, hence the loop rather than a grid over them.
__device__ __forceinline__ void split_reduce_column(const GemmParams& p, std::int64_t n) {
  if (n >= p.n) return;
  for (std::int64_t m = 0; m < p.m; ++m) split_reduce(p, m * p.n + n);
}

}  // namespace metrale::kernels
