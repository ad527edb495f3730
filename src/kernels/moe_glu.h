// The gated activation between an MoE layer's two grouped GEMMs (module "moe": moe_glu), shared by
// the CPU and GPU kernels: each row of the gate_up GEMM's output that belongs to an expert becomes
// the down GEMM's input row, in FP32 from the BF16 inputs and rounded once to BF16 (Note [MoE
// routing]). Plain data and __host__ __device__ rules only.
#pragma once

#include <cmath>
#include <cstdint>

#include "metrale/numerics.h"

namespace metrale {

enum MoeGluKind : std::uint32_t {
  // Qwen3-MoE, Mixtral, DeepSeek: a row is [gate | up]; SiLU(gate) · up.
  kMoeGluSilu = 0,
  // gpt-oss: gate the even, up the odd columns; gate clamped above at limit, up to ±limit;
  // gate · σ(alpha · gate) · (up + 1).
  kMoeGluClampedSwiglu = 1,
};

// Arguments of moe_glu, by value.
struct MoeGluParams {
  std::uint64_t y = 0;        // BF16 [row_capacity, 2 · inter]: the gate_up GEMM's C
  std::uint64_t act = 0;      // BF16 [row_capacity, inter], out
  std::uint64_t counts = 0;   // int32 [experts] (moe_align's)
  std::uint64_t offsets = 0;  // int32 [experts + 1] (moe_align's)
  std::int64_t row_capacity = 0, inter = 0;
  std::int64_t capacity = 0;  // masked layout's rows per expert; 0: contiguous
  std::int32_t experts = 0;
  std::uint32_t kind = kMoeGluSilu;
  float alpha = 0.0f, limit = 0.0f;  // kMoeGluClampedSwiglu
};

namespace moe {

// Whether row r holds an expert's entry: below the last expert's end when contiguous; within its
// expert's count when masked (the rows past it hold nothing, and are left unwritten).
METRALE_HD bool glu_row_used(const MoeGluParams& p, std::int64_t r) {
  const auto* offsets = reinterpret_cast<const std::int32_t*>(p.offsets);
  if (p.capacity == 0) return r < offsets[p.experts];
  const std::int64_t e = r / p.capacity;
  return r - e * p.capacity < reinterpret_cast<const std::int32_t*>(p.counts)[e];
}

// act[r, i]. The clamps are comparisons, not fminf, so a NaN stays a NaN (as torch.clamp keeps it).
METRALE_HD std::uint16_t glu_element(const MoeGluParams& p, std::int64_t r, std::int64_t i) {
  const auto* y = reinterpret_cast<const std::uint16_t*>(p.y) + r * 2 * p.inter;
  if (p.kind == kMoeGluSilu) {
    const float g = num::bf16_to_f32(y[i]);
    const float u = num::bf16_to_f32(y[p.inter + i]);
    return num::f32_to_bf16(g / (1.0f + expf(-g)) * u);
  }
  float g = num::bf16_to_f32(y[2 * i]);
  float u = num::bf16_to_f32(y[2 * i + 1]);
  if (g > p.limit) g = p.limit;
  if (u > p.limit) u = p.limit;
  if (u < -p.limit) u = -p.limit;
  return num::f32_to_bf16(g / (1.0f + expf(-p.alpha * g)) * (u + 1.0f));
}

}  // namespace moe
}  // namespace metrale
