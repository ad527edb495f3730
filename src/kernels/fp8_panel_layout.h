// The CPU's panel layout of E4M3 weights W[N, K] (Note [E4M3 panels]): columns in panels of 32,
// each panel's K pairs end to end, one pair of 32 columns in 64 bytes ordered so that AVX-512's
// in-lane byte interleave of the widened codes gives columns 0-15 in one vector and 16-31 in the
// other, a dword per column (even k low, odd k high): the BF16 pairs vdpbf16ps multiplies by a
// broadcast pair of A. The columns past N in the last panel hold code 0 (+0). Plain index math.
#pragma once

#include <cstdint>

#include "metrale/numerics.h"

namespace metrale::fp8_panels {

inline constexpr std::int64_t kCols = 32;       // columns per panel
inline constexpr std::int64_t kPairBytes = 64;  // one K pair of a panel's 32 columns

// Panels of N columns.
METRALE_HD constexpr std::int64_t panels(std::int64_t n) {
  return (n + kCols - 1) / kCols;
}

// Bytes of N x K weights in the layout (K even): whole panels.
METRALE_HD constexpr std::int64_t bytes(std::int64_t n, std::int64_t k) {
  return panels(n) * kCols * k;
}

// Byte of column c (< 32) and k parity kk within a pair's 64 bytes: the 128-bit lane c % 16 / 4,
// its low 8 bytes for columns 0-15 and high 8 for 16-31 (vpunpck{l,h}bw's halves), then the
// column's two codes side by side.
METRALE_HD constexpr std::int64_t pair_byte(std::int64_t c, std::int64_t kk) {
  return 16 * (c % 16 / 4) + 8 * (c / 16) + 2 * (c % 4) + kk;
}

// Byte of W[n, k] in N x K weights (K even).
METRALE_HD constexpr std::int64_t offset(std::int64_t n, std::int64_t k, std::int64_t k_total) {
  return n / kCols * kCols * k_total + k / 2 * kPairBytes + pair_byte(n % kCols, k % 2);
}

}  // namespace metrale::fp8_panels
