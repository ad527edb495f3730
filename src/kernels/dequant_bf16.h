// The dequantization of the dequant route (dequant_bf16): E2M1 codes with their block scale and
// the tensor scale to BF16, one code path for the GPU kernel (cuda/kernels/dequant_bf16.cuh), its
// CPU twin and the host tests.
//
// THE VALUE of a weight is bf16(e2m1 × block scale × tensor scale), the exact product rounded
// once to nearest even. When is it exact?
//  - e2m1 × block scale is exact in FP32 and in BF16: an E2M1 value has at most 2 significant bits
//    and an E4M3 scale at most 4 (6 ≤ BF16's 8), over 2^-10 ... 2688; an E8M0 scale is a power of
//    two, and 2^-128 ... 6 · 2^126 stays inside BF16's range (only an E8M0 scale of 2^127 times
//    |e2m1| ≥ 2 leaves FP32: table_of's shortcut still gives the exact value where the tensor
//    scale brings it back into range; off the shortcut it is ±inf, as in every other route).
//  - The tensor scale keeps it exact when it is a power of two (MXFP4's is 1) and the product stays
//    at or above 2^-126. Any other tensor scale has up to 24 significant bits, the product up to
//    30, and the rounding moves the weight by at most 2^-8 of itself (half a BF16 unit): the route
//    is then held to a tolerance that allows for it (toolkit/gemm_tolerance.h, kDequant).
// It cannot be applied later instead: the dense GEMM takes no alpha (dense_gemm.h), and scaling C
// after it would round C twice and add the bias before the scale.
//
// ROUNDED ONCE: the FP32 product is made round-to-odd (its residual, from one FMA, says which way
// the exact product lies), then rounded to BF16; with 16 spare bits that equals rounding the exact
// product directly. (Exact for products in FP32's normal range; below 2^-126 the FMA's residual
// can underflow to 0. No weight of a checkpoint is that small.)
//
// THE TABLE: a block scale (with the tensor scale) gives the 8 magnitudes ±{0, .5, 1, 1.5, 2, 3,
// 4, 6} × s one BF16 each; their low and high bytes are two 8-byte tables that byte permutes index
// with the codes' low 3 bits (as num::e2m1x4_to_bf16 does for unscaled values), so the rounding
// runs twice per block (table_of), not once per weight.
#pragma once

#include <cmath>
#include <cstdint>

#include "metrale/numerics.h"

namespace metrale::dequant {

// Weights per unit of the dequant_bf16 grid: one 16-byte load of codes in the source layout's rows.
inline constexpr std::int64_t kUnitWeights = 32;

// The grid's units for weights [N, K]: N × ceil(K / 32) (row-major weights use the first
// ceil(N·K / 32) of them, the rest return at once).
METRALE_HD std::int64_t unit_count(std::int64_t n, std::int64_t k) {
  return n * ((k + kUnitWeights - 1) / kUnitWeights);
}

// bf16(x × ts) for FP32 x and ts, the exact product rounded once to nearest even.
METRALE_HD std::uint16_t bf16_of_product(float x, float ts) {
  const float p = x * ts;
  if (p == 0.0f || !(p - p == 0.0f)) return num::f32_to_bf16(p);  // zero, inf, NaN
  const float r = fmaf(x, ts, -p);                                // x·ts − p, exact
  std::uint32_t bits = num::f32_bits(p);
  if (r != 0.0f && (bits & 1u) == 0) {
    // Inexact and p is even: the odd neighbour on the exact product's side.
    bits = ((r > 0.0f) == (p > 0.0f)) ? bits + 1 : bits - 1;
  }
  return num::f32_to_bf16(num::bits_f32(bits));
}

// The bytes of the BF16 values of the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} × scale × ts, rounded
// once: low bytes of codes 0-3 and 4-7, then high bytes.
struct Table {
  std::uint32_t low03, low47, high03, high47;
};

// The table from the 8 values' BF16 patterns.
METRALE_HD Table table_from(const std::uint32_t (&v)[8]) {
  return Table{(v[0] & 0xFFu) | (v[1] & 0xFFu) << 8 | (v[2] & 0xFFu) << 16 | (v[3] & 0xFFu) << 24,
               (v[4] & 0xFFu) | (v[5] & 0xFFu) << 8 | (v[6] & 0xFFu) << 16 | (v[7] & 0xFFu) << 24,
               v[0] >> 8 | (v[1] >> 8) << 8 | (v[2] >> 8) << 16 | (v[3] >> 8) << 24,
               v[4] >> 8 | (v[5] >> 8) << 8 | (v[6] >> 8) << 16 | (v[7] >> 8) << 24};
}

METRALE_HD Table table_of(float scale, float ts) {
  // The magnitudes are 1 and 1.5 times powers of two, and scaling by a power of two commutes with
  // rounding while everything stays a normal number: two roundings make all 8 values when
  // s·ts's exponent field lies in [3, 251] (×1/2 stays normal, ×4 of 1.5·s·ts finite); others
  // (subnormal, huge, inf or NaN scales) round each value.
  const std::uint32_t one = bf16_of_product(scale, ts);
  const std::uint32_t exp = (one >> 7) & 0xFFu;
  std::uint32_t v[8];
  if (exp >= 3 && exp <= 251) {
    const std::uint32_t three_halves = bf16_of_product(1.5f * scale, ts);
    constexpr std::uint32_t kTimes2 = 1u << 7;  // one more in the exponent field
    v[0] = one & 0x8000u;
    v[1] = one - kTimes2;
    v[2] = one;
    v[3] = three_halves;
    v[4] = one + kTimes2;
    v[5] = three_halves + kTimes2;
    v[6] = one + 2 * kTimes2;
    v[7] = three_halves + 2 * kTimes2;
  } else {
    for (std::uint32_t c = 0; c < 8; ++c) {
      v[c] = bf16_of_product(num::e2m1_to_f32(static_cast<std::uint8_t>(c)) * scale, ts);
    }
  }
  return table_from(v);
}

// Four codes, the nibbles of w's low 16 bits (lowest first), as four BF16 values in two words
// (element 0 in the low half of *p01): two permutes look up the low and high bytes, two more
// interleave them, and each code's sign bit flips its value's (a negative scale's values are
// negative in the table, so a sign is XORed, not ORed).
METRALE_HD void scaled_x4(const Table& t, std::uint32_t w, std::uint32_t* p01, std::uint32_t* p23) {
  const std::uint32_t sel = w & 0x7777u;
  const std::uint32_t low = num::byte_perm(t.low03, t.low47, sel);
  const std::uint32_t high = num::byte_perm(t.high03, t.high47, sel);
  const std::uint32_t signs = w & 0x8888u;
  *p01 = num::byte_perm(low, high, 0x5140u) ^ ((signs * 0x01001000u) & 0x80008000u);
  *p23 = num::byte_perm(low, high, 0x7362u) ^ ((signs * 0x00010010u) & 0x80008000u);
}

// Eight codes (one word: two bytes per pair of K) as 8 BF16 values, 16 bytes.
METRALE_HD void scaled_x8(const Table& t, std::uint32_t w, std::uint32_t (&out)[4]) {
  scaled_x4(t, w & 0xFFFFu, &out[0], &out[1]);
  scaled_x4(t, w >> 16, &out[2], &out[3]);
}

}  // namespace metrale::dequant
