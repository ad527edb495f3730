// A fresh-seeded random engine shared by a test program, and small draws from it. Tests draw new
// data every run; a failing case prints its inputs through the assertion that failed.
#pragma once

#include <cstddef>
#include <random>

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

}  // namespace metrale::testing
