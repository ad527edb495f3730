// Independent float64 references for the per-element formats of metrale/numerics.h, written from
// the format definitions (sign, exponent, mantissa and bias) rather than from the header's bit
// tricks: value tables are enumerated and the nearest value is picked by plain comparison in
// double. Shared by the numerics and quantizer tests.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace metrale::testing::ref {

// ---- BF16: 1 sign, 8 exponent (bias 127), 7 mantissa ----

inline double bf16_value(std::uint16_t h) {
  const bool neg = (h & 0x8000u) != 0;
  const int exp = (h >> 7) & 0xFF;
  const int man = h & 0x7F;
  double mag;
  if (exp == 0xFF) {
    mag = man == 0 ? std::numeric_limits<double>::infinity()
                   : std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<double>(man), -126 - 7);
  } else {
    mag = std::ldexp(1.0 + man / 128.0, exp - 127);
  }
  return neg ? -mag : mag;
}

// ---- FP8 E4M3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 is NaN ----

inline constexpr std::uint8_t kE4m3MaxCode = 0x7E;  // 448

// The value of an E4M3 code, from the format definition.
inline double e4m3_value(std::uint8_t c) {
  const bool neg = (c & 0x80u) != 0;
  const int exp = (c >> 3) & 0xF;
  const int man = c & 0x7;
  double mag;
  if (exp == 0xF && man == 0x7) {
    mag = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<double>(man), -6 - 3);  // 0.man × 2^(1-7)
  } else {
    mag = std::ldexp(1.0 + man / 8.0, exp - 7);
  }
  return neg ? -mag : mag;
}

// The 127 non-negative finite E4M3 magnitudes, indexed by code 0x00..0x7E (increasing).
inline const std::array<double, 127>& e4m3_magnitudes() {
  static const std::array<double, 127> table = [] {
    std::array<double, 127> t{};
    for (int c = 0; c <= kE4m3MaxCode; ++c) t[c] = e4m3_value(static_cast<std::uint8_t>(c));
    return t;
  }();
  return table;
}

// The E4M3 code nearest to x: ties to the even code, |x| >= 448 (infinities too) saturates to
// ±448, NaN gives the NaN code with x's sign, the sign bit follows x's (so -0 gives 0x80).
inline std::uint8_t nearest_e4m3(double x) {
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return static_cast<std::uint8_t>(sign | 0x7F);
  const double a = std::fabs(x);
  if (a >= 448.0) return static_cast<std::uint8_t>(sign | kE4m3MaxCode);
  const auto& mags = e4m3_magnitudes();
  int best = 0;
  for (int c = 1; c <= kE4m3MaxCode; ++c) {
    const double d = std::fabs(mags[c] - a);
    const double best_d = std::fabs(mags[best] - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c;
  }
  return static_cast<std::uint8_t>(sign | best);
}

// ---- FP4 E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa; no NaN or infinity ----

inline double e2m1_value(std::uint8_t c) {
  const bool neg = (c & 0x8u) != 0;
  const int exp = (c >> 1) & 0x3;
  const int man = c & 0x1;
  const double mag = exp == 0 ? man * 0.5 : std::ldexp(1.0 + man / 2.0, exp - 1);
  return neg ? -mag : mag;
}

// The E2M1 code nearest to x: ties to the even code, saturating to ±6, the sign bit follows x's
// (-0 and small negatives give 0x8, negative zero).
inline std::uint8_t nearest_e2m1(double x) {
  const std::uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  const double a = std::fabs(x);
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(e2m1_value(static_cast<std::uint8_t>(c)) - a);
    const double best_d = std::fabs(e2m1_value(static_cast<std::uint8_t>(best)) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c;
  }
  return static_cast<std::uint8_t>(sign | best);
}

// Half the spacing of the E2M1 grid around magnitude a in [0, 6]: neighbours are 0.5 apart up
// to 2, 1 apart up to 4 and 2 apart up to 6, so the nearest value is at most this far from a.
inline double e2m1_half_spacing(double a) {
  return a <= 2.0 ? 0.25 : a <= 4.0 ? 0.5 : 1.0;
}

// ---- E8M0: 8-bit biased exponent, 2^(e-127); 0xFF is NaN ----

inline double e8m0_value(std::uint8_t e) {
  return e == 0xFF ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, e - 127);
}

}  // namespace metrale::testing::ref
