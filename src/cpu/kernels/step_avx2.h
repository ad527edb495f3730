// One 64-weight step of the decode kernels with AVX2 (decode_avx2.cpp for E2M1, int4_avx2.cpp for
// INT4), shared: where A's elements go in a staged step, the 16-entry byte tables that vpshufb
// indexes with the codes' nibbles, and a step half's four FP32 vectors. Layout (decode_avx2.cpp's
// header): vector v = 4x + 2h + e holds, in lane l = 4L + i, the weight of code byte
// j = 16L + 8h + 2i + e, nibble x (k = 2j + x). Internal to src/cpu/kernels.
#pragma once

#include <immintrin.h>

#include <cstdint>

// See w4a16_cpu.cpp: the vector helpers are always inlined into functions with the same target.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace metrale::cpu::w4a16::detail::avx2_step {

inline constexpr std::int64_t kStep = 64;  // weights per step: 32 code bytes
// Prefetch distances in code bytes (one column's codes run on into the next's): a line into L1
// a little ahead and one into L2 far ahead, as decode_bf16.cpp (Note [L2 read-ahead distance]).
inline constexpr std::int64_t kPrefetchL1 = 2048, kPrefetchL2 = 16384;

// Where A's element k of a step goes in the staged step: position 8v + l.
struct StepOrder {
  std::uint8_t k[kStep];
};
inline constexpr StepOrder kOrder = [] {
  StepOrder o{};
  for (int v = 0; v < 8; ++v) {
    const int x = v / 4, h = (v / 2) % 2, e = v % 2;
    for (int l = 0; l < 8; ++l) {
      const int j = 16 * (l / 4) + 8 * h + 2 * (l % 4) + e;
      o.k[8 * v + l] = static_cast<std::uint8_t>(2 * j + x);
    }
  }
  return o;
}();

// The low and high bytes of a code's weight as BF16, in both 128-bit halves (vpshufb looks up
// within each half).
struct ByteTables {
  alignas(32) std::uint8_t low[32], high[32];
};
// The tables of bf16_of(c) for codes c = 0..15.
template <class Bf16Of>
ByteTables byte_tables_of(Bf16Of bf16_of) {
  ByteTables x{};
  for (int i = 0; i < 32; ++i) {
    const std::uint16_t b = bf16_of(i & 15);
    x.low[i] = static_cast<std::uint8_t>(b & 0xFF);
    x.high[i] = static_cast<std::uint8_t>(b >> 8);
  }
  return x;
}

// Half x (0: low nibbles, 1: high) of a step's 64 weights as FP32: vectors 4x + 0..3. The two
// lookups pair into BF16 words, and each dword's two words become two FP32 vectors without a
// multiply: the high word by masking the low one off, the low word by shifting it up.
struct Half {
  __m256 f[4];
};
[[gnu::target("avx2"), gnu::always_inline]] inline Half decode_half(__m256i nibbles, __m256i low,
                                                                    __m256i high) {
  const __m256i lo = _mm256_shuffle_epi8(low, nibbles), hi = _mm256_shuffle_epi8(high, nibbles);
  const __m256i wa = _mm256_unpacklo_epi8(lo, hi), wb = _mm256_unpackhi_epi8(lo, hi);
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(wa, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(wa, top)),
          _mm256_castsi256_ps(_mm256_slli_epi32(wb, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(wb, top))};
}

}  // namespace metrale::cpu::w4a16::detail::avx2_step
