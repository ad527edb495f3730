// How a BF16 GEMM rounds when it adds a bias, told element by element: on data whose products'
// sum P is exact in FP32 (small integers) and whose P + bias is exact too (a bias in eighths
// below 2^9), each output is RNE(P + bias) (one rounding), RNE(RNE(P) + bias) (the product
// rounded to BF16 before the bias is added), both (where they agree), or neither (wrong). Used
// on the real cuBLASLt (tests/gpu/dense_gemm_test.cpp) and the CPU backend
// (tests/cpu/dense_gemm_test.cpp); the dequant route's bound rests on what it finds
// (toolkit/gemm_tolerance.h).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "metrale/numerics.h"

namespace metrale::testing {

// A [M, 16] · B[N, 16]ᵀ + bias case with that data.
struct BiasRoundingCase {
  std::int64_t m = 0, n = 0, k = 16;
  std::vector<std::uint16_t> a, b, bias;
};

inline BiasRoundingCase bias_rounding_case(std::mt19937_64& rng, std::int64_t m, std::int64_t n) {
  std::uniform_int_distribution<int> small(-8, 8);
  std::uniform_int_distribution<int> eighths(-4096, 4096);  // multiples of 1/8 to ±512
  BiasRoundingCase c;
  c.m = m;
  c.n = n;
  for (std::int64_t i = 0; i < m * c.k; ++i) c.a.push_back(num::f32_to_bf16(float(small(rng))));
  for (std::int64_t i = 0; i < n * c.k; ++i) c.b.push_back(num::f32_to_bf16(float(small(rng))));
  for (std::int64_t i = 0; i < n; ++i)
    c.bias.push_back(num::f32_to_bf16(float(eighths(rng)) / 8.0f));
  return c;
}

struct BiasRoundingCounts {
  int once = 0, twice = 0, either = 0, neither = 0;
  std::string str() const {
    return std::to_string(once) + " elements rounded once only, " + std::to_string(twice) +
           " twice only, " + std::to_string(either) + " either, " + std::to_string(neither) +
           " neither";
  }
};

// P = Σ_k a·b of element (m, n), exact in FP32 (|P| ≤ 16·64).
inline float product(const BiasRoundingCase& c, std::int64_t m, std::int64_t n) {
  float p = 0;
  for (std::int64_t k = 0; k < c.k; ++k)
    p += num::bf16_to_f32(c.a[static_cast<std::size_t>(m * c.k + k)]) *
         num::bf16_to_f32(c.b[static_cast<std::size_t>(n * c.k + k)]);
  return p;
}

// RNE(RNE(P) + bias) of element (m, n): the product rounded to BF16 before the bias.
inline std::uint16_t rounded_twice(const BiasRoundingCase& c, std::int64_t m, std::int64_t n) {
  return num::f32_to_bf16(num::bf16_to_f32(num::f32_to_bf16(product(c, m, n))) +
                          num::bf16_to_f32(c.bias[static_cast<std::size_t>(n)]));
}

// out: the GEMM's C [M, N] in BF16.
inline BiasRoundingCounts classify_bias_rounding(const BiasRoundingCase& c,
                                                 std::span<const std::uint16_t> out) {
  BiasRoundingCounts r;
  for (std::int64_t m = 0; m < c.m; ++m) {
    for (std::int64_t n = 0; n < c.n; ++n) {
      const float bias = num::bf16_to_f32(c.bias[static_cast<std::size_t>(n)]);
      const std::uint16_t got = out[static_cast<std::size_t>(m * c.n + n)];
      // P + bias is exact in FP32: eighths below 2^11.
      const bool once = got == num::f32_to_bf16(product(c, m, n) + bias);
      const bool twice = got == rounded_twice(c, m, n);
      r.either += once && twice;
      r.once += once && !twice;
      r.twice += twice && !once;
      r.neither += !once && !twice;
    }
  }
  return r;
}

}  // namespace metrale::testing
