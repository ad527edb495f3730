// dequant_bf16 on the CPU. A unit is visited as the GPU's thread visits it (row-major: 32 weights
// of the flat code stream; transposed: 32 K of one column), 16 weights at a time, so a tail unit
// and the rows it may straddle take the same path as on the GPU.
#include "cpu/kernels/dequant_bf16_cpu.h"

#include <cstring>

#include "cpu/kernels/w4a16_shared.h"
#include "kernels/dequant_bf16.h"

namespace metrale::cpu::w4a16 {

using detail::at;
using detail::Weights;

void dequant_bf16(const GemmParams& p, std::int64_t u0, std::int64_t u1) {
  const Weights w(p);
  auto* out = at<std::uint16_t>(p.out);
  const std::int64_t total = p.n * p.k;
  for (std::int64_t u = u0; u < u1; ++u) {
    // The unit's first weight as (row, k): flat in row-major codes, column-chunk in transposed.
    std::int64_t row = 0, k0 = 0;
    if (w.transposed) {
      row = u % p.n;
      k0 = (u / p.n) * dequant::kUnitWeights;
      if (k0 >= p.k) continue;
    } else {
      const std::int64_t e0 = u * dequant::kUnitWeights;
      if (e0 >= total) continue;
      row = e0 / p.k;
      k0 = e0 % p.k;
    }
    // Two halves of 16 weights; each lies inside one row (K is a multiple of 16).
    for (int half = 0; half < 2; ++half) {
      if (half == 1) {
        k0 += 16;
        if (k0 == p.k) {
          if (w.transposed) break;  // a column's K chunk ends with the row
          ++row;
          k0 = 0;
        }
        if (row >= p.n || k0 > p.k - 16) break;
      }
      const dequant::Table t = dequant::table_of(w.scale(row, k0 / w.group), p.tensor_scale);
      for (int q = 0; q < 2; ++q) {
        std::uint32_t codes = 0;
        for (int j = 0; j < 8; ++j) {
          codes |= std::uint32_t{w.code(row, k0 + 8 * q + j)} << (4 * j);
        }
        std::uint32_t o[4];
        dequant::scaled_x8(t, codes, o);
        std::memcpy(out + row * p.k + k0 + 8 * q, o, sizeof o);
      }
    }
  }
}

}  // namespace metrale::cpu::w4a16
