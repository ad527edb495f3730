// A fresh-seeded random engine shared by a test program, and small draws from it. Tests draw new
// data every run; a failing case prints its inputs through the assertion that failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "metrale/numerics.h"

namespace metrale::testing {

// The program's engine, seeded once from std::random_device.
inline std::mt19937_64& rng() {
  static std::mt19937_64 gen{std::random_device{}()};
  return gen;
}

// A uniformly drawn size in [lo, hi].
inline std::size_t random_size(std::size_t lo, std::size_t hi) {
  return std::uniform_int_distribution<std::size_t>(lo, hi)(rng());
}

// count BF16 values drawn uniformly from [-1, 1].
inline std::vector<std::uint16_t> random_bf16(std::size_t count) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> v(count);
  for (auto& x : v) x = num::f32_to_bf16(u(rng()));
  return v;
}

// A host pointer as a kernel argument block's 64-bit address (GemmParams and its kin).
template <class T>
std::uint64_t address(const T* p) {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
}

}  // namespace metrale::testing
