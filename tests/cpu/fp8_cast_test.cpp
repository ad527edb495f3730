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
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

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

}  // namespace
}  // namespace metrale
