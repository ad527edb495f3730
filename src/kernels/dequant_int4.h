// The dequantization of the dequant route for INT4 weights in the INT4 decode layout
// (dequant_int4_bf16): one code path for the GPU kernel (w4a16.cu), its CPU twin and the host
// tests. A weight is bf16((q - z) x scale): q - z is a 5-bit integer and the scale has at most 11
// significant bits (FP16), so the FP32 product is exact and rounds once, to nearest even. That
// rounding (half a BF16 unit: 2^-9 of the weight) is the route's own error beside the dense
// GEMM's; the decode kernel rounds no weight (toolkit/gemm_tolerance.h, INT4 dequant).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "kernels/int4_decode_layout.h"
#include "metrale/numerics.h"

namespace metrale::dequant_int4 {

// Weights per unit: one lane chunk's 8 K of one row (two words of the codes buffer).
inline constexpr std::int64_t kUnitWeights = 8;

// The grid's units for weights [N, K] (K a multiple of 32, as every layout group needs).
METRALE_HD std::int64_t unit_count(std::int64_t n, std::int64_t k) {
  return n * (k / kUnitWeights);
}

// Unit u of p (INT4 weights in the decode layout): BF16 W for its 8 stored columns into p.out
// [N, K] row-major, in the stored order (under act order the GEMM gathers A into that order
// first: permute_a_int4). Units past N x K/8 do nothing.
METRALE_HD void unit(const GemmParams& p, std::int64_t u) {
  namespace dl = metrale::decode_layout;
  namespace i4 = metrale::int4_decode;
  const std::int64_t per_row = p.k / kUnitWeights;
  if (u < 0 || u >= p.n * per_row) return;
  const std::int64_t n = u / per_row, j0 = (u % per_row) * kUnitWeights;
  const std::int64_t kb_count = dl::k_blocks(p.k);
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes);
  const auto* side = reinterpret_cast<const std::uint8_t*>(p.scales);
  const std::int64_t at = i4::code_slot(n, j0, kb_count).byte;  // step 0's word; step 1's at + 8
  std::uint32_t words[2];
  std::memcpy(&words[0], codes + at, 4);
  std::memcpy(&words[1], codes + at + 8, 4);
  const i4::SideSlot s = i4::side_slot(n, j0, kb_count, p.group);
  std::uint16_t bits = 0;
  std::memcpy(&bits, side + s.scale, 2);
  const float scale = i4::scale_value(bits, (p.flags & kGemmFp16Scales) != 0);
  const int z = side[s.zero];
  const int upper = static_cast<int>((n % dl::kTileN) / 8 % 2);
  std::uint16_t out[kUnitWeights];
  for (int i = 0; i < kUnitWeights; ++i) {
    const int jj = i % 4, nibble = 2 * (jj / 2) + upper + 4 * (jj % 2);
    const int q = static_cast<int>((words[i / 4] >> (4 * nibble)) & 0xFu);
    out[i] = num::f32_to_bf16(static_cast<float>(q - z) * scale);
  }
  std::memcpy(reinterpret_cast<std::uint16_t*>(p.out) + n * p.k + j0, out, sizeof(out));
}

}  // namespace metrale::dequant_int4
