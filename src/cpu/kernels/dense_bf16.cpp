#include "cpu/kernels/dense_bf16.h"

#include <algorithm>
#include <cstddef>
#include <vector>

#include "cpu/kernels/dense_store.h"
#include "metrale/numerics.h"

namespace metrale::cpu::blas {
namespace {

// Eight partial sums in a fixed order: the compiler keeps them in one vector register, and the
// result does not depend on how the grid was cut.
constexpr std::int64_t kLanes = 8;

float dot(const float* x, const float* y, std::int64_t k) {
  float acc[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    for (std::int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j] * y[i + j];
  }
  for (; i < k; ++i) acc[i % kLanes] += x[i] * y[i];
  float s = 0.0f;
  for (const float v : acc) s += v;
  return s;
}

void widen(const std::uint16_t* in, std::int64_t count, float* out) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = num::bf16_to_f32(in[i]);
}

}  // namespace

void gemm_bf16(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  const auto* a = reinterpret_cast<const std::uint16_t*>(p.a);
  const auto* b = reinterpret_cast<const std::uint16_t*>(p.b);
  const auto* bias = reinterpret_cast<const std::uint16_t*>(p.bias);
  const auto k = static_cast<std::size_t>(p.k), cols = static_cast<std::size_t>(n1 - n0);
  // The block's rows of B widened once (a BF16 product is exact in FP32), then each row of A.
  std::vector<float> bw(cols * k), aw(k);
  widen(b + static_cast<std::size_t>(n0) * k, static_cast<std::int64_t>(cols * k), bw.data());
  for (std::int64_t m = 0; m < p.m; ++m) {
    widen(a + static_cast<std::size_t>(m) * k, p.k, aw.data());
    for (std::size_t j = 0; j < cols; ++j) {
      float v = dot(aw.data(), bw.data() + j * k, p.k);
      if (bias != nullptr) v += num::bf16_to_f32(bias[static_cast<std::size_t>(n0) + j]);
      store_c(p,
              static_cast<std::size_t>(m) * static_cast<std::size_t>(p.n) +
                  static_cast<std::size_t>(n0) + j,
              v);
    }
  }
}

}  // namespace metrale::cpu::blas
