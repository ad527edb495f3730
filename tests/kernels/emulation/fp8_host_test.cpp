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

#include "support/fp8_reference.h"

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

// The grouped W8A8 GEMM's GPU source (gemm_grouped_e4m3_block128) run on the host: the grid the op
// plans (N tiles x experts), 256 threads per block as fibers, on E4M3 A cast by fp8_cast.h's rules
// and random E4M3 weights per expert, against the float64 product of those codes (exact: the
// aware reference of tests/ops/grouped_fp8_test.cpp) with its FP32 bound. C is poisoned; rows of
// no expert must stay so. What this reaches that the CPU test cannot: the kernel's lane and column
// indexing, the 2-row passes and their tails, the 4-column warps at N's edge, the 16-code widening
// through FP16, the shuffle reduction, the per-expert strides and an A block holding inf.
TEST(GroupedFp8Host, TheGpuSourceMatchesFloat64) {
  namespace f8 = metrale::testing::fp8;
  std::mt19937_64 rng(20261206);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-12, 4);
  struct Shape {
    std::int64_t n, k;
    std::vector<std::int32_t> counts;
    bool bias, out_f32;
  };
  for (const Shape& sh :
       {Shape{72, 272, {3, 0, 5, 1}, true, false}, Shape{30, 1040, {2, 2}, false, true},
        Shape{129, 128, {0, 7, 0}, true, true}}) {
    const std::int64_t experts = static_cast<std::int64_t>(sh.counts.size());
    std::int64_t rows = 1;  // one spare row, of no expert
    std::vector<std::int32_t> offsets{0};
    for (const std::int32_t c : sh.counts) offsets.push_back(offsets.back() + c);
    rows += offsets.back();
    SCOPED_TRACE(::testing::Message() << "N=" << sh.n << " K=" << sh.k << " rows=" << rows);
    const std::int64_t kb = f8::blocks(sh.k), lda = (rows + 3) / 4 * 4, ldw = (kb + 3) / 4 * 4;
    // A: codes and scales by the cast's rules, from BF16-representable values.
    std::vector<std::uint8_t> a(static_cast<std::size_t>(rows * sh.k));
    std::vector<float> as(static_cast<std::size_t>(kb * lda), 0.0f);
    for (std::int64_t i = 0; i < rows; ++i) {
      for (std::int64_t b = 0; b < kb; ++b) {
        std::vector<float> x;
        float amax = 0.0f;
        for (std::int64_t q = b * 128; q < std::min(sh.k, b * 128 + 128); ++q) {
          x.push_back(num::bf16_to_f32(num::f32_to_bf16(std::ldexp(mant(rng), expo(rng)))));
          amax = fp8::amax_step(amax, x.back());
        }
        const float s = fp8::block_scale(amax);
        as[static_cast<std::size_t>(b * lda + i)] = s;
        for (std::size_t j = 0; j < x.size(); ++j)
          a[static_cast<std::size_t>(i * sh.k + b * 128) + j] = fp8::encode(x[j], s);
      }
    }
    // Row 0's last K block holds +inf: its scale is inf and its inf code NaN (the cast's rule).
    as[static_cast<std::size_t>((kb - 1) * lda)] = std::numeric_limits<float>::infinity();
    a[static_cast<std::size_t>(sh.k - 1)] = 0x7F;
    // Weights: experts end to end, codes and the device's padded scales.
    std::vector<f8::HostFp8Weights> w;
    const std::size_t codes_stride = static_cast<std::size_t>(sh.n * sh.k + 256) / 256 * 256;
    const std::size_t scales_stride =
        static_cast<std::size_t>(f8::blocks(sh.n) * ldw * 4 + 256) / 256 * 256;
    std::vector<std::uint8_t> codes(codes_stride * static_cast<std::size_t>(experts));
    std::vector<std::uint8_t> scales(scales_stride * static_cast<std::size_t>(experts));
    for (std::int64_t e = 0; e < experts; ++e) {
      w.push_back(f8::random_weights(sh.n, sh.k, rng));
      std::memcpy(codes.data() + e * codes_stride, w.back().codes.data(), w.back().codes.size());
      for (std::int64_t r = 0; r < f8::blocks(sh.n); ++r) {
        std::memcpy(scales.data() + e * scales_stride + static_cast<std::size_t>(r * ldw * 4),
                    w.back().scales.data() + r * kb, static_cast<std::size_t>(kb * 4));
      }
    }
    std::vector<std::uint16_t> bias(static_cast<std::size_t>(experts * sh.n));
    for (auto& x : bias) x = num::f32_to_bf16(mant(rng));
    const std::size_t elem = sh.out_f32 ? 4 : 2;
    std::vector<std::uint8_t> c(static_cast<std::size_t>(rows * sh.n) * elem, 0xFF);
    GroupedFp8Params g;
    g.a = reinterpret_cast<std::uintptr_t>(a.data());
    g.a_scales = reinterpret_cast<std::uintptr_t>(as.data());
    g.b = reinterpret_cast<std::uintptr_t>(codes.data());
    g.b_scales = reinterpret_cast<std::uintptr_t>(scales.data());
    g.c = reinterpret_cast<std::uintptr_t>(c.data());
    g.bias = sh.bias ? reinterpret_cast<std::uintptr_t>(bias.data()) : 0;
    g.counts = reinterpret_cast<std::uintptr_t>(sh.counts.data());
    g.offsets = reinterpret_cast<std::uintptr_t>(offsets.data());
    g.b_stride = codes_stride;
    g.b_scales_stride = scales_stride;
    g.rows = rows;
    g.n = sh.n;
    g.k = sh.k;
    g.experts = experts;
    g.out_f32 = sh.out_f32 ? 1 : 0;
    const dim3 grid(static_cast<unsigned>((sh.n + gemm_grouped_e4m3_block128_n_tile - 1) /
                                          gemm_grouped_e4m3_block128_n_tile),
                    static_cast<unsigned>(experts));
    const std::string error =
        emu::run_grid(grid, static_cast<int>(gemm_grouped_e4m3_block128_block_threads),
                      {{a.data(), a.size()}, {codes.data(), codes.size()}},
                      [&g] { gemm_grouped_e4m3_block128(g); });
    ASSERT_EQ(error, "");
    const double u8 = sh.out_f32 ? 0.0 : std::ldexp(1.0, -8);
    const double gamma = static_cast<double>(sh.k + 2 * (sh.k / 16) + 8) * std::ldexp(1.0, -23);
    for (std::int64_t e = 0; e < experts; ++e) {
      for (std::int64_t i = offsets[e]; i < offsets[e + 1]; ++i) {
        for (std::int64_t j = 0; j < sh.n; ++j) {
          const std::size_t at = static_cast<std::size_t>(i * sh.n + j);
          double got = 0.0;
          bool written = true;
          if (sh.out_f32) {
            float f;
            std::memcpy(&f, c.data() + at * 4, 4);
            written = num::f32_bits(f) != 0xFFFFFFFFu;
            got = f;
          } else {
            std::uint16_t h;
            std::memcpy(&h, c.data() + at * 2, 2);
            written = h != 0xFFFF;
            got = num::bf16_to_f32(h);
          }
          ASSERT_TRUE(written) << "C[" << i << ", " << j << "] was not written";
          if (i == 0) {
            ASSERT_TRUE(std::isnan(got)) << "row 0 holds inf in A: C[0, " << j << "] = " << got;
            continue;
          }
          double ref = sh.bias ? num::bf16_to_f32(bias[static_cast<std::size_t>(e * sh.n + j)]) : 0;
          double mag = std::fabs(ref);
          for (std::int64_t q = 0; q < sh.k; ++q) {
            const double x = static_cast<double>(num::e4m3_to_f32(a[i * sh.k + q])) *
                             as[static_cast<std::size_t>((q / 128) * lda + i)];
            ref += x * w[e].at(j, q);
            mag += std::fabs(x * w[e].at(j, q));
          }
          ASSERT_LE(std::fabs(got - ref), u8 * std::fabs(ref) + (1 + u8) * gamma * mag)
              << "C[" << i << ", " << j << "] of expert " << e << " = " << got << ", reference "
              << ref;
        }
      }
    }
    // The spare last row belongs to no expert.
    const auto* last = c.data() + static_cast<std::size_t>((rows - 1) * sh.n) * elem;
    EXPECT_TRUE(std::all_of(last, last + sh.n * elem, [](std::uint8_t v) { return v == 0xFF; }))
        << "the row of no expert was written";
  }
}

}  // namespace
}  // namespace metrale
