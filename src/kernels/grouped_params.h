// The argument block of the grouped GEMM kernels (w4a16 entries gemm_grouped, gemm_grouped_packed,
// gemm_grouped_int4_decode, the fused ones and gemm_grouped_split_reduce): one GEMM per expert in
// one launch, grid y the expert. Expert e multiplies its rows [offsets[e], offsets[e] +
// counts[e]) of A (the permuted activations, ops/moe.h) by its own weights, laid end to end in one
// buffer per tensor, into the same rows of C. The counts and offsets are read on the device, so
// the launch does not depend on them. Plain data and __host__ __device__ rules only.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"
#include "metrale/numerics.h"

namespace metrale {

struct GroupedGemmParams {
  // Expert 0's GEMM: its codes, scales and bias; A and C over all `gemm.m` rows (the row
  // capacity); tensor_scale and weight_fold unused (per expert, below). Split-K (gemm.splits >
  // 1): `gemm.workspace` holds FP32 partials of splits x rows x N, expert e's own [splits,
  // counts[e], N] from its first row's offset times `splits` (expert_params), which
  // gemm_grouped_split_reduce sums.
  GemmParams gemm;
  std::uint64_t counts = 0;   // int32 [experts]
  std::uint64_t offsets = 0;  // int32 [experts + 1]
  // FP32 [experts] tensor scales, then int32 [experts] weight folds.
  std::uint64_t expert_table = 0;
  std::uint64_t codes_stride = 0, scales_stride = 0;  // bytes from one expert's to the next's
  std::int64_t experts = 0;
};

namespace grouped {

// Expert e's GEMM into *p: false when it has no rows, or (a caller's own counts and offsets) rows
// outside [0, gemm.m), which it then leaves alone rather than reach outside A or C.
METRALE_HD bool expert_params(const GroupedGemmParams& g, std::int64_t e, GemmParams* p) {
  if (e >= g.experts) return false;
  const std::int64_t m = reinterpret_cast<const std::int32_t*>(g.counts)[e];
  const std::int64_t first = reinterpret_cast<const std::int32_t*>(g.offsets)[e];
  if (m <= 0 || first < 0 || first > g.gemm.m - m) return false;
  *p = g.gemm;
  p->m = m;
  p->a += static_cast<std::uint64_t>(first * g.gemm.k * 2);
  const std::int64_t c_bytes = (g.gemm.flags & kGemmOutF32) != 0 ? 4 : 2;
  p->out += static_cast<std::uint64_t>(first * g.gemm.n * c_bytes);
  p->codes += static_cast<std::uint64_t>(e) * g.codes_stride;
  p->scales += static_cast<std::uint64_t>(e) * g.scales_stride;
  if ((g.gemm.flags & kGemmBias) != 0) p->bias += static_cast<std::uint64_t>(e * g.gemm.n * 2);
  // Split-K partials: expert e's slices [splits, m, N] (the dense kernels' layout for its m rows)
  // start where rows before its first would end theirs, so no two experts' slices meet.
  if (g.gemm.splits > 1) {
    p->workspace += static_cast<std::uint64_t>(first * g.gemm.splits * g.gemm.n * 4);
  }
  const auto* table = reinterpret_cast<const float*>(g.expert_table);
  p->tensor_scale = table[e];
  p->weight_fold = reinterpret_cast<const std::int32_t*>(table + g.experts)[e];
  return true;
}

}  // namespace grouped
}  // namespace metrale
