// What the decode kernels' host-emulation tests share: C's poison values, device addresses of host
// buffers, a fresh seed per run (METRALE_EMULATION_SEED replays one) and random BF16 data.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "metrale/numerics.h"

namespace metrale::emulation {

inline constexpr std::uint16_t kPoisonC = 0x7FC1;     // a BF16 NaN: an unwritten element fails
inline constexpr std::uint16_t kPoisonTail = 0x5A5A;  // past C: must stay
inline constexpr std::size_t kTail = 64;              // poisoned elements past C and the workspace

// A host buffer as the kernels' GemmParams address it.
inline std::uint64_t address(const void* p) {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
}

// A fresh seed each run, printed; METRALE_EMULATION_SEED replays one.
inline std::mt19937_64 seeded_rng() {
  std::random_device rd;
  std::uint64_t seed = (std::uint64_t{rd()} << 32) | rd();
  if (const char* fixed = std::getenv("METRALE_EMULATION_SEED"))
    seed = std::strtoull(fixed, nullptr, 10);
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

// count BF16 values uniform in [-1, 1).
inline std::vector<std::uint16_t> random_bf16(std::size_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> v(count);
  for (auto& x : v) x = num::f32_to_bf16(u(rng));
  return v;
}

}  // namespace metrale::emulation
