// The argument block of the grouped W8A8 GEMM (module "fp8", entry gemm_grouped_e4m3_block128):
// every expert's block-scaled FP8 GEMM in one launch, grid y the expert. A is the permuted
// activations already cast to E4M3 (cast_e4m3_block128 over all `rows`: codes [rows, K], FP32
// scales [ceil(K/128), scales_ld(rows)]); expert e multiplies its rows [offsets[e], offsets[e] +
// counts[e]) by its own E4M3 weights (codes [N, K] and FP32 scales [ceil(N/128), round_up(ceil(K
// /128), 4)], laid end to end) into the same rows of C. Counts and offsets are read on the device,
// so the launch does not depend on them. Plain data and __host__ __device__ rules only.
#pragma once

#include <cstdint>

#include "kernels/fp8_cast.h"
#include "metrale/numerics.h"

namespace metrale {

struct GroupedFp8Params {
  std::uint64_t a = 0;         // E4M3 [rows, K]
  std::uint64_t a_scales = 0;  // FP32 [ceil(K/128), fp8::scales_ld(rows)]
  std::uint64_t b = 0;         // expert 0's E4M3 codes [N, K] (b_panels: fp8_panel_layout.h's)
  std::uint64_t b_scales = 0;  // expert 0's FP32 scales [ceil(N/128), round_up(ceil(K/128), 4)]
  std::uint64_t c = 0;         // [rows, N] BF16, FP32 with out_f32
  std::uint64_t bias = 0;      // BF16 [experts, N], or 0
  std::uint64_t counts = 0;    // int32 [experts]
  std::uint64_t offsets = 0;   // int32 [experts + 1]
  std::uint64_t b_stride = 0, b_scales_stride = 0;  // bytes from one expert's to the next's
  std::int64_t rows = 0, n = 0, k = 0, experts = 0;
  std::uint32_t out_f32 = 0;
  // Non-zero: the codes are in the CPU's panel layout (a kernel that publishes `panels` only).
  std::uint32_t b_panels = 0;
};

namespace grouped_fp8 {

// Expert e's rows: false when it has none, or (a caller's own counts and offsets) rows outside
// [0, rows), which the kernels then leave alone rather than reach outside A or C.
METRALE_HD bool expert_rows(const GroupedFp8Params& g, std::int64_t e, std::int64_t* first,
                            std::int64_t* m) {
  if (e >= g.experts) return false;
  *m = reinterpret_cast<const std::int32_t*>(g.counts)[e];
  *first = reinterpret_cast<const std::int32_t*>(g.offsets)[e];
  return *m > 0 && *first >= 0 && *first <= g.rows - *m;
}

// One lane's 16-product sum d of codes widened at 2^-8 each (num::e4m3x4_to_f16_scaled) as its
// share of C: d · 2^16 (exact, a power of two) times the A scale a_scale and the weights' scale
// w_scale. An A block holding ±inf has an infinite scale and NaN codes for those elements, which
// the widening cannot show: its share is NaN, as the CPU kernel's (fp8_cast.h: "never a silently
// finite number").
METRALE_HD float scaled_partial(float d, float a_scale, float w_scale) {
  if (!(a_scale - a_scale == 0.0f)) return a_scale - a_scale;  // inf − inf and NaN are NaN
  return d * 65536.0f * (a_scale * w_scale);
}

}  // namespace grouped_fp8
}  // namespace metrale
