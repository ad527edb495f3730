// Module "fp8"'s GPU source (cuda/kernels/fp8.cu) run on the host: every block of the grid the
// op plans, its 256 threads as fibers, the warp's shuffle emulated below. Codes and scales are
// poisoned first and must all be written (the scales' padding columns never); each scale must be
// the block's amax / 448 (1 for an all-zero block), each code numerics.h's E4M3 rounding of x /
// scale: the rules of kernels/fp8_cast.h, which the CPU twin (tests/cpu/fp8_cast_test.cpp) is held
// to as well. What this reaches that the CPU test cannot: the kernel's pair and lane indexing, the
// K tail, the warps past the last pair, and the shuffle reduction.
#include "cuda_host.h"  // first: the CUDA language on the host

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

// What fp8.cu uses beyond cuda_host.h: __launch_bounds__ (a hint only) and a warp's XOR
// shuffle (warp_host.h).
#define __launch_bounds__(...)
#include "warp_host.h"

#include "cuda/kernels/fp8.cu"

#include <gtest/gtest.h>

namespace metrale {
namespace {

namespace emu = metrale::emulation;

TEST(Fp8CastHost, TheGpuSourceFollowsTheRules) {
  std::mt19937_64 rng(20261201);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-12, 6);
  for (const auto& [m, k] :
       {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 100}, {2, 128}, {5, 300}, {9, 257}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << m << " K=" << k);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
    for (auto& x : a) x = num::f32_to_bf16(std::ldexp(mant(rng), expo(rng)));
    if (k > 1) std::fill(a.begin(), a.begin() + std::min<std::int64_t>(k, 128), std::uint16_t{0});
    // Scales [ceil(K/128), round_up(M, 4)], the padding poisoned too.
    const std::int64_t kb = (k + 127) / 128, lda = (m + 3) / 4 * 4;
    std::vector<std::uint8_t> codes(a.size(), 0x7F);
    std::vector<float> scales(static_cast<std::size_t>(kb * lda),
                              std::numeric_limits<float>::quiet_NaN());
    const Fp8CastParams p{reinterpret_cast<std::uintptr_t>(a.data()),
                          reinterpret_cast<std::uintptr_t>(codes.data()),
                          reinterpret_cast<std::uintptr_t>(scales.data()), m, k};
    // The grid the op plans: ceil(pairs / n_tile) blocks of the published block size.
    const auto blocks =
        static_cast<unsigned>((m * kb + cast_e4m3_block128_n_tile - 1) / cast_e4m3_block128_n_tile);
    const std::string error =
        emu::run_grid(dim3(blocks), static_cast<int>(cast_e4m3_block128_block_threads),
                      {{a.data(), a.size() * 2}}, [&p] { cast_e4m3_block128(p); });
    ASSERT_EQ(error, "");
    for (std::int64_t b = 0; b < kb; ++b) {
      for (std::int64_t i = m; i < lda; ++i) {
        EXPECT_TRUE(std::isnan(scales[static_cast<std::size_t>(b * lda + i)]))
            << "padding scale [" << b << ", " << i << "] was written";
      }
    }
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t b = 0; b < kb; ++b) {
        float amax = 0.0f;
        for (std::int64_t q = b * 128; q < std::min(k, b * 128 + 128); ++q)
          amax =
              std::max(amax, std::fabs(num::bf16_to_f32(a[static_cast<std::size_t>(i * k + q)])));
        const float s = scales[static_cast<std::size_t>(b * lda + i)];
        ASSERT_EQ(s, amax == 0.0f ? 1.0f : amax / 448.0f) << "scale of row " << i << " block " << b;
        for (std::int64_t q = b * 128; q < std::min(k, b * 128 + 128); ++q) {
          const auto at = static_cast<std::size_t>(i * k + q);
          ASSERT_EQ(codes[at], num::f32_to_e4m3(num::bf16_to_f32(a[at]) / s))
              << "code of A[" << i << ", " << q << "]";
        }
      }
    }
  }
}

}  // namespace
}  // namespace metrale
