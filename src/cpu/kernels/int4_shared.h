// What the CPU kernels for INT4 weights share (Note [INT4 weights]): typed access to the codes
// (row-major, or in the panel layout) and the side buffer (kernels/int4_layout.h). Under act order
// A arrives in the weights' stored order (the op gathers it first: permute_a_int4), so no kernel
// reads the permutation. Internal to src/cpu/kernels.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"
#include "kernels/int4_layout.h"
#include "kernels/panel_layout.h"
#include "metrale/numerics.h"

namespace metrale::cpu::w4a16::detail {

struct Int4Weights {
  const std::uint8_t* codes;
  const std::uint8_t* scales;  // [N, groups] x 2 bytes (in panel order with `panels`)
  const std::uint8_t* zeros;   // [N, groups] alike, or null: every zero point is 8
  std::int64_t n, k, group, groups;
  bool fp16;
  bool panels;  // codes in the panel layout (kernels/panel_layout.h), else row-major

  explicit Int4Weights(const GemmParams& p)
      : codes(reinterpret_cast<const std::uint8_t*>(static_cast<std::uintptr_t>(p.codes))),
        scales(reinterpret_cast<const std::uint8_t*>(static_cast<std::uintptr_t>(p.scales))),
        zeros(nullptr),
        n(p.n),
        k(p.k),
        group(p.group),
        groups(p.k / p.group),
        fp16((p.flags & kGemmFp16Scales) != 0),
        panels((p.flags & kGemmPanels) != 0) {
    const auto side = int4_layout::side_of(p.n, p.k, p.group, (p.flags & kGemmZeroPoints) != 0,
                                           (p.flags & kGemmActOrder) != 0);
    if (p.flags & kGemmZeroPoints) zeros = scales + side.zeros;
  }

  // The code at stored column j of row.
  std::uint8_t code(std::int64_t row, std::int64_t j) const {
    if (panels) return panel_layout::code_at(codes, k, row, j);
    const std::uint8_t byte = codes[row * (k / 2) + (j >> 1)];
    return (j & 1) ? static_cast<std::uint8_t>(byte >> 4) : static_cast<std::uint8_t>(byte & 0xF);
  }
  // Where entry [row, g] of the scales and zero points lies: row-major, or in the panel order
  // (int4_layout::panel_entry) with the codes in the panel layout.
  std::int64_t entry(std::int64_t row, std::int64_t g) const {
    return panels ? static_cast<std::int64_t>(int4_layout::panel_entry(n, groups, row, g))
                  : row * groups + g;
  }
  // The scale of group g of row, as float (exact).
  float scale(std::int64_t row, std::int64_t g) const {
    const std::uint8_t* s = scales + 2 * entry(row, g);
    const auto bits = static_cast<std::uint16_t>(s[0] | (s[1] << 8));
    return fp16 ? num::f16_to_f32(bits) : num::bf16_to_f32(bits);
  }
  int zero(std::int64_t row, std::int64_t g) const {
    return zeros != nullptr ? zeros[entry(row, g)] : 8;
  }
};

// BF16 bits of (i & 15) − 8 for i < 32: the INT4 kernels' lookup of code − 8 by vpermw, which
// reads 5 index bits (the fifth a neighbouring nibble's, ignored by the doubled table).
struct Int4Bf16Lut {
  alignas(64) std::uint16_t words[32];
};
inline const Int4Bf16Lut& int4_bf16_lut() {
  static const Int4Bf16Lut lut = [] {
    Int4Bf16Lut x{};
    for (int i = 0; i < 32; ++i) x.words[i] = num::f32_to_bf16(static_cast<float>((i & 15) - 8));
    return x;
  }();
  return lut;
}

}  // namespace metrale::cpu::w4a16::detail
