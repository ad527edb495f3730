// Host pieces the W8A8 tests share: E4M3 weights with 128 x 128 block scales made from floats
// (a test's own quantizer, so the tests do not depend on the library's), and the float64
// references of the W8A8 GEMM, with A exact (BF16) or cast as the op casts it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "metrale/numerics.h"

namespace metrale::testing::fp8 {

inline std::int64_t blocks(std::int64_t v) {
  return (v + 127) / 128;
}

// W[N, K] as E4M3 codes and FP32 scales [ceil(N/128), ceil(K/128)]: each block's amax / 448.
struct HostFp8Weights {
  std::int64_t n = 0, k = 0;
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
  // The scales as the bytes an upload takes.
  std::vector<std::uint8_t> scale_bytes() const {
    std::vector<std::uint8_t> b(scales.size() * 4);
    std::memcpy(b.data(), scales.data(), b.size());
    return b;
  }
  // W[n, k] as the GEMM sees it.
  double at(std::int64_t r, std::int64_t c) const {
    return static_cast<double>(num::e4m3_to_f32(codes[static_cast<std::size_t>(r * k + c)])) *
           scales[static_cast<std::size_t>((r / 128) * blocks(k) + c / 128)];
  }
};

inline HostFp8Weights quantize(const std::vector<float>& w, std::int64_t n, std::int64_t k) {
  HostFp8Weights q{n, k, std::vector<std::uint8_t>(w.size()),
                   std::vector<float>(static_cast<std::size_t>(blocks(n) * blocks(k)))};
  for (std::int64_t bn = 0; bn < blocks(n); ++bn) {
    for (std::int64_t bk = 0; bk < blocks(k); ++bk) {
      float amax = 0.0f;
      for (std::int64_t r = bn * 128; r < std::min(n, bn * 128 + 128); ++r)
        for (std::int64_t c = bk * 128; c < std::min(k, bk * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(w[static_cast<std::size_t>(r * k + c)]));
      const float s = amax == 0.0f ? 1.0f : amax / 448.0f;
      q.scales[static_cast<std::size_t>(bn * blocks(k) + bk)] = s;
      for (std::int64_t r = bn * 128; r < std::min(n, bn * 128 + 128); ++r)
        for (std::int64_t c = bk * 128; c < std::min(k, bk * 128 + 128); ++c)
          q.codes[static_cast<std::size_t>(r * k + c)] =
              num::f32_to_e4m3(w[static_cast<std::size_t>(r * k + c)] / s);
    }
  }
  return q;
}

// Random weights, magnitudes over a few binades.
inline HostFp8Weights random_weights(std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-3, 1);
  std::vector<float> w(static_cast<std::size_t>(n * k));
  for (auto& x : w) x = std::ldexp(u(rng), e(rng));
  return quantize(w, n, k);
}

// A's cast as the op casts it (the rules of kernels/fp8_cast.h, restated): each value as code ×
// scale, and each element's scale.
struct CastA {
  std::vector<double> value, scale;
};

inline CastA cast_a(const std::vector<std::uint16_t>& a, std::int64_t m, std::int64_t k) {
  CastA out{std::vector<double>(a.size()), std::vector<double>(a.size())};
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t b = 0; b < blocks(k); ++b) {
      float amax = 0.0f;
      const std::int64_t k0 = b * 128, k1 = std::min(k, k0 + 128);
      for (std::int64_t q = k0; q < k1; ++q)
        amax = std::max(amax, std::fabs(num::bf16_to_f32(a[static_cast<std::size_t>(i * k + q)])));
      const float s = amax == 0.0f ? 1.0f : amax / 448.0f;
      for (std::int64_t q = k0; q < k1; ++q) {
        const auto at = static_cast<std::size_t>(i * k + q);
        out.value[at] =
            static_cast<double>(num::e4m3_to_f32(num::f32_to_e4m3(num::bf16_to_f32(a[at]) / s))) *
            s;
        out.scale[at] = s;
      }
    }
  }
  return out;
}

}  // namespace metrale::testing::fp8
