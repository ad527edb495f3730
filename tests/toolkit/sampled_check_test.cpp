// The sampled check of the CLI and the benchmarks (toolkit/sampled_check.h) with the one
// tolerance table (toolkit/gemm_tolerance.h): the CPU backend's GEMM passes it on every route and
// format, also at the benchmarks' K (far beyond the K = 1040 of the norm bound's worst case),
// and a wrong or unwritten output fails it.
#include "toolkit/sampled_check.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/random_weights.h"

namespace metrale::toolkit {
namespace {

using R = ops::GemmRoute;

struct Gemm {
  std::vector<std::uint16_t> a, c;
  HostQuantWeights w;
};

// C = A · Wᵀ on the CPU backend by route, with the benchmarks' data: random_weights and
// activations uniform in [-1, 1].
Gemm run(R route, WeightFormat format, std::int64_t m, std::int64_t n, std::int64_t k,
         std::mt19937_64& rng) {
  CpuBackend b(CpuBackendOptions{builtin_host_modules(), 2});
  Gemm g;
  g.w = random_weights(format, n, k, rng);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  g.a.resize(static_cast<std::size_t>(m * k));
  for (auto& x : g.a) x = num::f32_to_bf16(unit(rng));
  ops::QuantWeights w = ops::upload_weights(b, g.w);
  const DevicePtr da = b.alloc(g.a.size() * 2), dc = b.alloc(static_cast<std::size_t>(m * n) * 2);
  b.copy_h2d(da, g.a.data(), g.a.size() * 2);
  b.memset(dc, 0xFF, static_cast<std::size_t>(m * n) * 2);
  ops::GemmOptions o;
  o.route = route;
  if (route == R::kE4m3) o.activations = ops::Activations::kAllowE4m3;
  ops::w4a16_gemm(b, b.default_stream(), da, m, w, dc, o);
  g.c.resize(static_cast<std::size_t>(m * n));
  b.copy_d2h(g.c.data(), dc, g.c.size() * 2);
  b.free(da);
  b.free(dc);
  ops::free_weights(b, w);
  b.op_cache().release(b);
  return g;
}

TEST(GemmTolerance, TheTableIsTheTestSuitesBounds) {
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const R r : {R::kDecode, R::kTiled}) {
      EXPECT_EQ(gemm_tolerance(r, f).reference, AMode::kBf16);
      EXPECT_EQ(gemm_tolerance(r, f).normalized, kNormTol);
    }
    EXPECT_EQ(gemm_tolerance(R::kE4m3, f).reference, AMode::kE4m3);
    EXPECT_EQ(gemm_tolerance(R::kE4m3, f).normalized, kNormTol);
  }
}

TEST(SampledCheck, EveryRouteAndFormatPassesAtTheBenchmarksK) {
  std::mt19937_64 rng(std::random_device{}());
  // Llama-3-8B's down projection's K, and a K of the tests' range.
  for (const std::int64_t k : {14336, 1024}) {
    for (const auto& [route, m] : {std::tuple{R::kDecode, 1}, std::tuple{R::kDecode, 16},
                                   std::tuple{R::kTiled, 20}, std::tuple{R::kE4m3, 64}}) {
      for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
        SCOPED_TRACE(fmt::format("{} {} M={} K={}", ops::to_string(route), to_string(f), m, k));
        const Gemm g = run(route, f, m, 64, k, rng);
        const SampledCheck s = sampled_check(g.a, g.c, g.w, m, route, rng);
        EXPECT_TRUE(s.passed()) << s.str();
        EXPECT_EQ(s.samples, 96);
        EXPECT_EQ(s.tolerance, kNormTol);
      }
    }
  }
}

TEST(SampledCheck, AWrongOrUnwrittenOutputFails) {
  std::mt19937_64 rng(std::random_device{}());
  Gemm g = run(R::kDecode, WeightFormat::kNvfp4, 4, 64, 512, rng);
  ASSERT_TRUE(sampled_check(g.a, g.c, g.w, 4, R::kDecode, rng).passed());
  // 3% too large everywhere: above the norm bound.
  std::vector<std::uint16_t> off = g.c;
  for (auto& x : off) x = num::f32_to_bf16(num::bf16_to_f32(x) * 1.03f);
  const SampledCheck s = sampled_check(g.a, off, g.w, 4, R::kDecode, rng);
  EXPECT_FALSE(s.passed()) << s.str();
  EXPECT_GT(s.normalized, kNormTol);
  // Unwritten (the NaN poison): fails.
  std::vector<std::uint16_t> poison(g.c.size(), 0xFFFF);
  EXPECT_FALSE(sampled_check(g.a, poison, g.w, 4, R::kDecode, rng).passed());
  // The e4m3 route's output held to the exact-BF16 route's reference entry is another check:
  // the e4m3 output of the same data fails the decode entry's bounds.
  const Gemm e = run(R::kE4m3, WeightFormat::kNvfp4, 64, 64, 4096, rng);
  EXPECT_TRUE(sampled_check(e.a, e.c, e.w, 64, R::kE4m3, rng).passed());
  EXPECT_FALSE(sampled_check(e.a, e.c, e.w, 64, R::kTiled, rng).passed());
}

// C = A · Wᵀ on the CPU backend's dense BF16 GEMM, A and W uniform in [-1, 1] rounded to BF16.
struct DenseGemm {
  std::vector<std::uint16_t> a, w, c;
};
DenseGemm run_dense(std::int64_t m, std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  CpuBackend b(CpuBackendOptions{builtin_host_modules(), 2});
  DenseGemm g;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  g.a.resize(static_cast<std::size_t>(m * k));
  g.w.resize(static_cast<std::size_t>(n * k));
  for (auto& x : g.a) x = num::f32_to_bf16(unit(rng));
  for (auto& x : g.w) x = num::f32_to_bf16(unit(rng));
  const DenseGemmPlan plan = b.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, m, n, k});
  DenseGemmArgs args;
  args.a = b.alloc(g.a.size() * 2);
  args.b = b.alloc(g.w.size() * 2);
  args.c = b.alloc(static_cast<std::size_t>(m * n) * 2);
  if (plan.workspace_bytes > 0) args.workspace = b.alloc(plan.workspace_bytes);
  args.workspace_bytes = plan.workspace_bytes;
  b.copy_h2d(args.a, g.a.data(), g.a.size() * 2);
  b.copy_h2d(args.b, g.w.data(), g.w.size() * 2);
  b.memset(args.c, 0xFF, static_cast<std::size_t>(m * n) * 2);
  b.run_dense_gemm(plan, args, b.default_stream());
  b.synchronize(b.default_stream());
  g.c.resize(static_cast<std::size_t>(m * n));
  b.copy_d2h(g.c.data(), args.c, g.c.size() * 2);
  for (const DevicePtr p : {args.a, args.b, args.c, args.workspace}) {
    if (p) b.free(p);
  }
  b.op_cache().release(b);
  return g;
}

TEST(SampledCheck, DenseBf16PassesAndAWrongOrUnwrittenOutputFails) {
  std::mt19937_64 rng(std::random_device{}());
  for (const auto& [m, k] : {std::tuple{1, 14336}, std::tuple{20, 1024}}) {
    SCOPED_TRACE(fmt::format("M={} K={}", m, k));
    const DenseGemm g = run_dense(m, 48, k, rng);
    const SampledCheck s = sampled_check_dense_bf16(g.a, g.c, g.w, 48, k, m, rng);
    EXPECT_TRUE(s.passed()) << s.str();
    EXPECT_EQ(s.tolerance, kNormTol);
    // 3% too large everywhere, every output read from the next row of W, the NaN poison: each
    // fails. (Two rows swapped was this case once: at M = 1 only two outputs moved, and about one
    // run in 40 drew two rows whose outputs lay within each other's bounds.)
    std::vector<std::uint16_t> off = g.c;
    for (auto& x : off) x = num::f32_to_bf16(num::bf16_to_f32(x) * 1.03f);
    EXPECT_FALSE(sampled_check_dense_bf16(g.a, off, g.w, 48, k, m, rng).passed());
    std::vector<std::uint16_t> swapped = g.w;
    std::rotate(swapped.begin(), swapped.begin() + k, swapped.end());
    EXPECT_FALSE(sampled_check_dense_bf16(g.a, g.c, swapped, 48, k, m, rng).passed());
    const std::vector<std::uint16_t> poison(g.c.size(), 0xFFFF);
    EXPECT_FALSE(sampled_check_dense_bf16(g.a, poison, g.w, 48, k, m, rng).passed());
  }
  const std::vector<std::uint16_t> a(64), w(63), c(2);
  const Error e = testing::expect_error([&] { sampled_check_dense_bf16(a, c, w, 2, 32, 2, rng); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), ::testing::HasSubstr("[sampled_check_dense_bf16] M = 2"));
}

TEST(SampledCheck, ShapesThatDoNotMatchAreRefused) {
  std::mt19937_64 rng(3);
  const HostQuantWeights w = random_weights(WeightFormat::kNvfp4, 8, 32, rng);
  const std::vector<std::uint16_t> a(2 * 32), c(2 * 8);
  for (const auto& [m, an, cn] : {std::tuple{0, 64, 16}, std::tuple{3, 64, 16},
                                  std::tuple{2, 63, 16}, std::tuple{2, 64, 15}}) {
    const Error e = testing::expect_error([&] {
      sampled_check(std::span(a).first(static_cast<std::size_t>(an)),
                    std::span(c).first(static_cast<std::size_t>(cn)), w, m, R::kDecode, rng);
    });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), ::testing::HasSubstr(fmt::format("[sampled_check] M = {}", m)));
  }
}

}  // namespace
}  // namespace metrale::toolkit
