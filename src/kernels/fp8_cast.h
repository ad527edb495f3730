// The activation cast of the W8A8 op (module "fp8", entry cast_e4m3_block128), shared by the
// CPU and GPU kernels so both compute the same bytes: BF16 A [M, K] → E4M3 codes [M, K] and one
// FP32 scale per row per 128 K, stored K-block-major [ceil(K/128), round_up(M, 4)] (the layout
// of DenseKind::kE4m3Block128's a_scales; the padding columns m >= M are left unwritten). Plain
// data and __host__ __device__ rules only.
#pragma once

#include <cstdint>

#include "metrale/numerics.h"

namespace metrale {

// Arguments of cast_e4m3_block128, by value. in, codes 16-byte aligned (the op checks).
struct Fp8CastParams {
  std::uint64_t in = 0;      // BF16 [M, K]
  std::uint64_t codes = 0;   // E4M3 [M, K]
  std::uint64_t scales = 0;  // FP32 [ceil(K/128), scales_ld(M)]
  std::int64_t m = 0, k = 0;
};

namespace fp8 {

inline constexpr std::int64_t kCastBlock = 128;  // K elements per scale
inline constexpr float kE4m3Max = 448.0f;        // E4M3's largest finite value

// The scales' leading dimension for M rows: round_up(M, 4), dense_a_scales_ld's value (the op
// asserts they agree), spelled here so the GPU kernel needs no host header.
METRALE_HD constexpr std::int64_t scales_ld(std::int64_t m) {
  return (m + 3) / 4 * 4;
}

// The larger of amax and |x|, NaN once either is NaN (so a NaN in a block poisons its scale).
METRALE_HD float amax_step(float amax, float x) {
  const float v = x < 0.0f ? -x : x;
  return (v > amax || v != v) ? v : amax;
}

// The scale of a block whose largest magnitude is amax: amax / 448, so the largest maps onto
// E4M3's largest finite value. An all-zero block (amax 0) gets 1: its codes are then ±0 and every
// product with them 0, and nothing divides by 0. A block holding NaN or ±inf gets NaN or inf,
// and its codes NaN (x / inf is 0 only for finite x, ±inf / inf is NaN): the outputs of its row
// are NaN, never a silently finite number.
METRALE_HD float block_scale(float amax) {
  return amax == 0.0f ? 1.0f : amax / kE4m3Max;
}

// The code of x in a block of scale s: one FP32 division, then the project's one E4M3 rounding
// (RNE, saturating at ±448: amax / fl(amax / 448) may land a hair above 448).
METRALE_HD std::uint8_t encode(float x, float s) {
  return num::f32_to_e4m3(x / s);
}

}  // namespace fp8
}  // namespace metrale
