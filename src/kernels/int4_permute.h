// Act order (permute_a_int4): A's columns gathered into the weights' stored order once per call,
// A_s[m, j] = A[m, k_perm[j]], so that the INT4 GEMM kernels read A as plainly as without act
// order (Marlin permutes A the same way). One code path for the GPU kernel
// (w4a16.cu), its CPU twin and the host tests.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/int4_layout.h"
#include "metrale/numerics.h"

namespace metrale::int4_permute {

// Elements per thread: 8 BF16, one 16-byte store.
inline constexpr std::int64_t kUnitElements = 8;

// The grid's units for A [M, K]: ceil(K / 8) per row (the source layout takes any even K).
METRALE_HD std::int64_t unit_count(std::int64_t m, std::int64_t k) {
  return m * ((k + kUnitElements - 1) / kUnitElements);
}

// Where the permutation starts in the side buffer of either layout: it ends both.
METRALE_HD std::uint64_t perm_offset(const GemmParams& p) {
  if ((p.flags & kGemmDecodePacked) != 0) {
    return static_cast<std::uint64_t>(int4_decode::sizes_of(p.n, p.k, p.group, true).perm);
  }
  return int4_layout::side_of(p.n, p.k, p.group, (p.flags & kGemmZeroPoints) != 0, true).perm;
}

// Unit u: p.out[m, j .. j + 8) = p.a[m, k_perm[j + i]] for A [M, a_k] (p.a_k, or K where it is
// 0), the permutation read from p.scales (the side buffer of the INT4 decode layout under
// kGemmDecodePacked, else of the source layout). An index outside A's columns reads 0: the -1 of
// a K slice's padding (metrale/quant.h, k_perm), and whatever weights built by hand hold (the
// upload checks those it packs). Units past M x K/8 do nothing.
METRALE_HD void unit(const GemmParams& p, std::int64_t u) {
  const std::int64_t per_row = (p.k + kUnitElements - 1) / kUnitElements;
  if (u < 0 || u >= p.m * per_row) return;
  const std::int64_t m = u / per_row, j0 = (u % per_row) * kUnitElements;
  const std::int64_t a_k = p.a_k > 0 ? p.a_k : p.k;
  const auto* perm = reinterpret_cast<const std::int32_t*>(
      reinterpret_cast<const std::uint8_t*>(p.scales) + perm_offset(p));
  const auto* a = reinterpret_cast<const std::uint16_t*>(p.a) + m * a_k;
  auto* out = reinterpret_cast<std::uint16_t*>(p.out) + m * p.k + j0;
  // A loop of constant length with a guard, not one of `count`: an array indexed past unrolling
  // would live in local memory on the device.
  for (int i = 0; i < kUnitElements; ++i) {
    if (j0 + i >= p.k) break;
    const auto c = static_cast<std::uint32_t>(perm[j0 + i]);
    out[i] = c < static_cast<std::uint64_t>(a_k) ? a[c] : std::uint16_t{0};
  }
}

}  // namespace metrale::int4_permute
