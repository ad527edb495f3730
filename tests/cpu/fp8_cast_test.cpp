// Module "fp8"'s activation cast on the CPU (cast_e4m3_block128, rules in kernels/fp8_cast.h):
// launched as the W8A8 op launches it, over ragged K (a short tail block), with codes and scales
// poisoned first (everything must be written; the scales' padding columns, never). Each scale must
// be the block's amax / 448 in FP32 (1 for an all-zero block), each code the project's one E4M3
// rounding of x / scale, and the decoded code × scale within E4M3's half step of x: 2^-4 of |x| in
// the normal range, 2^-10 of the scale in the subnormal one, plus the FP32 quotient's own rounding
// (2^-24 of |x|, which can carry a value just past a tie).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/kernels/fp8_cpu.h"
#include "kernels/fp8_cast.h"
#include "metrale/cpu_backend.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::rng;

struct Cast {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
};

Cast run_cast(CpuBackend& be, const std::vector<std::uint16_t>& a, std::int64_t m, std::int64_t k) {
  // Scales [ceil(K/128), round_up(M, 4)], the padding included in the poison.
  const std::int64_t kb = (k + 127) / 128, lda = fp8::scales_ld(m);
  const DevicePtr in = be.alloc(a.size() * 2), codes = be.alloc(a.size()),
                  scales = be.alloc(static_cast<std::size_t>(kb * lda) * 4);
  be.copy_h2d(in, a.data(), a.size() * 2);
  Cast out{std::vector<std::uint8_t>(a.size(), 0x7F),
           std::vector<float>(static_cast<std::size_t>(kb * lda),
                              std::numeric_limits<float>::quiet_NaN())};
  be.copy_h2d(codes, out.codes.data(), out.codes.size());
  be.copy_h2d(scales, out.scales.data(), out.scales.size() * 4);
  const ResolvedKernel& kern = be.op_cache().kernel(be, "fp8", "cast_e4m3_block128");
  const std::uint64_t tile = be.kernel_n_tile(kern);
  const Fp8CastParams p{in.address(), codes.address(), scales.address(), m, k};
  be.launch_typed(kern.handle, Dim3{static_cast<std::uint32_t>((m * kb + tile - 1) / tile)},
                  Dim3{kern.meta.block_threads}, 0, be.default_stream(),
                  std::array{KernelArg::value(p)});
  be.copy_d2h(out.codes.data(), codes, out.codes.size());
  be.copy_d2h(out.scales.data(), scales, out.scales.size() * 4);
  for (DevicePtr x : {in, codes, scales}) be.free(x);
  return out;
}

TEST(CpuFp8Cast, ScalesAndCodesFollowTheRules) {
  CpuBackend be;
  for (const auto& [m, k] :
       {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 100}, {5, 128}, {4, 300}, {70, 257}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << m << " K=" << k);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
    // Magnitudes over many binades, so blocks reach E4M3's subnormals after scaling.
    std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
    std::uniform_int_distribution<int> expo(-12, 6);
    for (auto& x : a) x = num::f32_to_bf16(std::ldexp(mant(rng()), expo(rng())));
    // Row 0's first block all zero (one -0 among them), when it exists beyond a one-element row.
    if (k > 1) {
      std::fill(a.begin(), a.begin() + std::min<std::int64_t>(k, 128), std::uint16_t{0});
      a[1] = 0x8000;
    }
    const Cast c = run_cast(be, a, m, k);
    const std::int64_t kb = (k + 127) / 128, lda = (m + 3) / 4 * 4;
    ASSERT_EQ(fp8::scales_ld(m), lda);
    for (std::int64_t b = 0; b < kb; ++b) {
      for (std::int64_t i = m; i < lda; ++i) {
        EXPECT_TRUE(std::isnan(c.scales[static_cast<std::size_t>(b * lda + i)]))
            << "padding scale [" << b << ", " << i << "] was written";
      }
    }
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t b = 0; b < kb; ++b) {
        float amax = 0.0f;
        for (std::int64_t q = b * 128; q < std::min(k, b * 128 + 128); ++q) {
          amax =
              std::max(amax, std::fabs(num::bf16_to_f32(a[static_cast<std::size_t>(i * k + q)])));
        }
        const float s = c.scales[static_cast<std::size_t>(b * lda + i)];
        ASSERT_EQ(s, amax == 0.0f ? 1.0f : amax / 448.0f) << "scale of row " << i << " block " << b;
        for (std::int64_t q = b * 128; q < std::min(k, b * 128 + 128); ++q) {
          const auto at = static_cast<std::size_t>(i * k + q);
          const float x = num::bf16_to_f32(a[at]);
          ASSERT_EQ(c.codes[at], num::f32_to_e4m3(x / s)) << "code of A[" << i << ", " << q << "]";
          const double back = static_cast<double>(num::e4m3_to_f32(c.codes[at])) * s;
          const double ax = std::fabs(static_cast<double>(x));
          ASSERT_LE(std::fabs(back - x),
                    std::max(std::ldexp(ax, -4), std::ldexp(static_cast<double>(s), -10)) +
                        std::ldexp(ax, -23))
              << "A[" << i << ", " << q << "] = " << x << " comes back as " << back;
        }
      }
    }
  }
}

TEST(CpuFp8Cast, ABlockWithNanOrInfinityGivesNanCodes) {
  CpuBackend be;
  std::vector<std::uint16_t> a(256, num::f32_to_bf16(1.0f));
  a[3] = 0x7FC0;    // NaN in block 0
  a[130] = 0x7F80;  // +inf in block 1
  const Cast c = run_cast(be, a, 1, 256);
  EXPECT_TRUE(std::isnan(c.scales[0]));
  EXPECT_TRUE(std::isinf(c.scales[4]));  // block 1 of row 0: lda = round_up(1, 4) = 4
  for (const std::size_t i : {std::size_t{0}, std::size_t{3}, std::size_t{130}}) {
    EXPECT_TRUE(std::isnan(num::e4m3_to_f32(c.codes[i]))) << "code " << i;
  }
}

// The AVX-512 cast (fp8_cast_avx512.cpp) against the scalar rules it restates in vector form.
bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// Every upper half of a float's bits (every sign, exponent and the top 7 mantissa bits) with lower
// halves at and around the rounding ties of E4M3's 3 mantissa bits and of its subnormal grid, at
// scale 1 (x / 1 is x): each code as f32_to_e4m3 gives it.
TEST(CpuFp8CastAvx512, EncoderMatchesTheScalarRoundingAroundEveryTie) {
  if (!has_avx512()) GTEST_SKIP() << "the processor lacks AVX-512 F/BW/VL/DQ";
  const std::array<std::uint32_t, 10> lows = {0x0000, 0x0001, 0x3FFF, 0x4000, 0x7FFF,
                                              0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFF};
  std::vector<float> x;
  for (std::uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (const std::uint32_t lo : lows) x.push_back(std::bit_cast<float>(hi << 16 | lo));
  }
  std::vector<std::uint8_t> got(x.size(), 0x5A);
  cpu::fp8::encode_e4m3_avx512(x.data(), 1.0f, got.data(), static_cast<std::int64_t>(x.size()));
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (got[i] != num::f32_to_e4m3(x[i]) && ++wrong <= 5) {
      ADD_FAILURE() << "bits 0x" << std::hex << std::bit_cast<std::uint32_t>(x[i]) << ": code 0x"
                    << int{got[i]} << ", scalar 0x" << int{num::f32_to_e4m3(x[i])};
    }
  }
  EXPECT_EQ(wrong, 0u);
}

// Random values over FP32's whole range divided by random scales, a tail of 16 included: each
// code fp8::encode's (the division rounds as the scalar one does).
TEST(CpuFp8CastAvx512, EncoderMatchesTheScalarQuotients) {
  if (!has_avx512()) GTEST_SKIP() << "the processor lacks AVX-512 F/BW/VL/DQ";
  std::uniform_int_distribution<std::uint32_t> bits;
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-40, 40);
  for (int t = 0; t < 2000; ++t) {
    const float s = std::ldexp(mant(rng()), expo(rng()));
    std::vector<float> x(101);
    for (auto& v : x) v = std::bit_cast<float>(bits(rng()));
    std::vector<std::uint8_t> got(x.size(), 0x5A);
    cpu::fp8::encode_e4m3_avx512(x.data(), s, got.data(), static_cast<std::int64_t>(x.size()));
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(got[i], fp8::encode(x[i], s)) << "x = " << x[i] << ", s = " << s;
    }
  }
}

// The whole kernel against the scalar one, byte for byte (NaN scales' bits included), on ragged
// K with blocks holding zeros, infinities and NaN among values over many binades.
TEST(CpuFp8CastAvx512, KernelWritesTheScalarKernelsBytes) {
  if (!has_avx512()) GTEST_SKIP() << "the processor lacks AVX-512 F/BW/VL/DQ";
  for (const auto& [m, k] :
       {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 100}, {6, 300}, {17, 128}, {9, 1040}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << m << " K=" << k);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
    std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
    std::uniform_int_distribution<int> expo(-30, 30);
    std::uniform_int_distribution<int> special(0, 400);
    for (auto& x : a) {
      const int r = special(rng());
      x = r == 0   ? std::uint16_t{0x7FC1}  // NaN with a payload
          : r == 1 ? std::uint16_t{0xFF80}  // -inf
          : r < 40 ? std::uint16_t{0x8000}
                   : num::f32_to_bf16(std::ldexp(mant(rng()), expo(rng())));
    }
    // The last row: BF16 subnormals only (a subnormal scale), and no NaN.
    std::uniform_int_distribution<int> tiny(0, 0x7F);
    for (std::int64_t q = 0; q < k; ++q) {
      a[static_cast<std::size_t>((m - 1) * k + q)] =
          static_cast<std::uint16_t>(tiny(rng()) | (q % 2 ? 0x8000 : 0));
    }
    const std::int64_t kb = (k + 127) / 128, lda = fp8::scales_ld(m);
    std::vector<std::uint8_t> codes[2] = {std::vector<std::uint8_t>(a.size(), 0x5A),
                                          std::vector<std::uint8_t>(a.size(), 0xA5)};
    std::vector<float> scales[2] = {std::vector<float>(static_cast<std::size_t>(kb * lda), 3.0f),
                                    std::vector<float>(static_cast<std::size_t>(kb * lda), 3.0f)};
    for (int v = 0; v < 2; ++v) {
      const Fp8CastParams p{reinterpret_cast<std::uint64_t>(a.data()),
                            reinterpret_cast<std::uint64_t>(codes[v].data()),
                            reinterpret_cast<std::uint64_t>(scales[v].data()), m, k};
      // The vector kernel in two calls split at an odd pair, as two threads would run it.
      if (v == 0) {
        cpu::fp8::cast_e4m3_block128_scalar(p, 0, m * kb);
      } else {
        const std::int64_t split = std::min(m * kb, (m * kb) / 2 | 1);
        cpu::fp8::cast_e4m3_block128_avx512(p, 0, split);
        cpu::fp8::cast_e4m3_block128_avx512(p, split, m * kb);
      }
    }
    EXPECT_EQ(codes[0], codes[1]);
    EXPECT_EQ(std::memcmp(scales[0].data(), scales[1].data(), scales[0].size() * 4), 0);
  }
}

}  // namespace
}  // namespace metrale
