// Rounding a double to a narrow format in two steps without double rounding, shared by the host
// quantizers (core/quant.cpp, core/e4m3_block.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "metrale/numerics.h"

namespace metrale::detail {

// Double to float rounded to odd: truncate, then set the last bit when anything was dropped.
// Rounding that float to a narrower format (E4M3, E2M1) to nearest even then gives the correctly
// rounded result of the double itself: float keeps far more than the two extra bits round-to-odd
// needs, so no tie is invented or lost by the float step (a plain float cast could round onto an
// E4M3 or E2M1 midpoint and the second rounding would then go the wrong way).
inline float to_f32_round_odd(double d) {
  float f = static_cast<float>(d);  // round to nearest even
  if (static_cast<double>(f) == d || std::isnan(d)) return f;
  std::uint32_t u = num::f32_bits(f);
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) --u;  // rounded away from zero: step back
  return num::bits_f32(u | 1u);
}

}  // namespace metrale::detail
