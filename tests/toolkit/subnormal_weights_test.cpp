// A checkpoint layer whose BF16 weights are all subnormal (|w| ≤ 127·2^-133 < 2^-126), quantized
// to NVFP4 as `metrale bench --weights` quantizes it, is computed by the CPU backend's GEMM within
// the tolerance table's bounds on every route (gemm_tolerance.h, "Underflow": BF16's output
// rounding in its subnormal range is absolute, not relative), and a wrong output still fails.
#include <gtest/gtest.h>

#include <random>
#include <tuple>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/sampled_check.h"

namespace metrale::toolkit {
namespace {

using R = ops::GemmRoute;

// N×K BF16 weights of random subnormal patterns 0x0001…0x007F (either sign), as floats.
std::vector<float> subnormal_weights(std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> bits(1, 0x7F), sign(0, 1);
  std::vector<float> w(static_cast<std::size_t>(n * k));
  for (float& x : w) {
    x = num::bf16_to_f32(static_cast<std::uint16_t>(bits(rng) | (sign(rng) << 15)));
  }
  return w;
}

// C = A · Wᵀ on the CPU backend by route, A uniform in [-1, 1], C poisoned first.
std::vector<std::uint16_t> run(const HostQuantWeights& hw, std::span<const std::uint16_t> a,
                               std::int64_t m, R route) {
  CpuBackend b(CpuBackendOptions{builtin_host_modules(), 2});
  ops::QuantWeights w = ops::upload_weights(b, hw);
  const DevicePtr da = b.alloc(a.size() * 2), dc = b.alloc(static_cast<std::size_t>(m * hw.n) * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  b.memset(dc, kPoisonByte, static_cast<std::size_t>(m * hw.n) * 2);
  ops::GemmOptions o;
  o.route = route;
  if (route == R::kE4m3) o.activations = ops::Activations::kAllowE4m3;
  ops::w4a16_gemm(b, b.default_stream(), da, m, w, dc, o);
  std::vector<std::uint16_t> c(static_cast<std::size_t>(m * hw.n));
  b.copy_d2h(c.data(), dc, c.size() * 2);
  b.free(da);
  b.free(dc);
  ops::free_weights(b, w);
  b.op_cache().release(b);
  return c;
}

TEST(SubnormalWeights, EveryRouteIsWithinTheBoundAndAWrongOutputIsNot) {
  const auto seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr std::int64_t n = 16, k = 16;
  const HostQuantWeights hw = quantize_nvfp4(subnormal_weights(n, k, rng), n, k);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (const auto& [route, m] :
       {std::tuple{R::kDecode, 1}, std::tuple{R::kTiled, 20}, std::tuple{R::kDequant, 1},
        std::tuple{R::kDequant, 20}, std::tuple{R::kE4m3, 20}}) {
    SCOPED_TRACE(::testing::Message() << ops::to_string(route) << " M = " << m);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
    for (auto& x : a) x = num::f32_to_bf16(unit(rng));
    std::vector<std::uint16_t> c = run(hw, a, m, route);
    const GemmTolerance tol = gemm_tolerance(route, WeightFormat::kNvfp4);
    const Reference ref = reference(a, m, hw, {}, tol);
    const Comparison cmp = compare(c, ref);
    EXPECT_TRUE(within(cmp, tol)) << cmp.str();
    std::mt19937_64 pick(seed);
    const SampledCheck s = sampled_check(a, c, hw, m, route, pick);
    EXPECT_TRUE(s.passed()) << s.str();
    // The largest output doubled: off by |ref|, far beyond 2^-8·|ref| and the underflow terms.
    std::size_t top = 0;
    for (std::size_t i = 0; i < ref.value.size(); ++i) {
      if (std::fabs(ref.value[i]) > std::fabs(ref.value[top])) top = i;
    }
    c[top] = num::f32_to_bf16(2.0f * num::bf16_to_f32(c[top]));
    EXPECT_FALSE(within(compare(c, ref), tol));
    // Every output doubled fails the sampled check too.
    for (auto& x : c) x = num::f32_to_bf16(2.0f * num::bf16_to_f32(x));
    std::mt19937_64 pick2(seed);
    EXPECT_FALSE(sampled_check(a, c, hw, m, route, pick2).passed());
  }
}

// The underflow terms are absolute and below 2^-120 for any K a model has: beside an output of
// ordinary magnitude they change nothing.
TEST(SubnormalWeights, TheUnderflowTermIsNegligibleInTheNormalRange) {
  EXPECT_LT(underflow_bound(1 << 20, 0.0, 0.0), 0x1p-120);
  EXPECT_LT(underflow_bound(1 << 20, kDequantWeightUnit, 1 << 20), 0x1p-110);
  EXPECT_EQ(element_bound(1.0, 1.0, 1024, AMode::kBf16) - underflow_bound(1024, 0.0, 0.0),
            kBf16Unit + (1.0 + kBf16Unit) * 1032 * kAccumUnit);
}

}  // namespace
}  // namespace metrale::toolkit
