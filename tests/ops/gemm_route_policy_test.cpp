// The automatic route on the CPU backend: never dequant → dense BF16 (its dense GEMM is a plain
// reference, slower than its tiled kernel, so its dequant_bf16 publishes no smallest M; the CUDA
// side of the rule: tests/cuda/gemm_route_policy_test.cpp); the fused route for weights in the
// decode layout above the decode sizes, computing what the float64 reference does; the fused
// route refused on weights in their source layout.
#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "core/expect_error.h"
#include "kernels/manifest.h"
#include "kernels/verified_devices.h"
#include "metrale/cpu_backend.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "support/random.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/random_weights.h"

namespace metrale {
namespace {

TEST(GemmRoutePolicy, TheCpuBackendNeverTakesDequantAutomatically) {
  CpuBackend be;
  EXPECT_EQ(be.op_cache().kernel(be, "w4a16", "dequant_bf16").meta.min_m, 0u);
  const HostQuantWeights hw =
      toolkit::random_weights(WeightFormat::kNvfp4, 64, 128, testing::rng());
  ops::QuantWeights w = ops::upload_weights(be, hw);
  for (const std::int64_t m : {17, 256, 4096, 65536})
    EXPECT_EQ(ops::choose_route(be, m, w), ops::GemmRoute::kTiled) << "M=" << m;
  ops::free_weights(be, w);
}

// The CPU's w4a16 entries are the reference every device result is compared with: each publishes
// so (kernels/verified_devices.h), so the rule that CUDA's automatic choices take only kernels a
// device verified leaves the CPU's choices as they were (the fused route below among them).
TEST(GemmRoutePolicy, EveryCpuEntryIsTheHostReference) {
  CpuBackend be;
  for (const std::string_view e : manifest::kW4a16Entries) {
    const KernelMeta& meta = be.op_cache().kernel(be, "w4a16", e).meta;
    EXPECT_EQ(meta.verified_on, verified::kHostReference) << e;
    EXPECT_FALSE(meta.absent) << e;
  }
}

TEST(GemmRoutePolicy, DecodeLayoutWeightsTakeTheFusedRouteAboveTheDecodeSizes) {
  CpuBackend be;
  const std::int64_t n = 96, k = 256;
  const HostQuantWeights hw = toolkit::random_weights(WeightFormat::kNvfp4, n, k, testing::rng());
  ops::QuantWeights w = ops::upload_weights(be, hw, ops::UploadLayout::kDecode);
  EXPECT_EQ(ops::choose_route(be, ops::decode_max_m(be), w), ops::GemmRoute::kDecode);
  for (const std::int64_t m : {ops::decode_max_m(be) + 1, std::int64_t{70}}) {
    ASSERT_EQ(ops::choose_route(be, m, w), ops::GemmRoute::kFused) << "M=" << m;
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : a) x = num::f32_to_bf16(u(testing::rng()));
    const DevicePtr da = be.alloc(a.size() * 2), dc = be.alloc(static_cast<std::size_t>(m * n * 2));
    be.copy_h2d(da, a.data(), a.size() * 2);
    be.memset(dc, 0xFF, static_cast<std::size_t>(m * n * 2));  // poison: NaN in BF16
    const ops::GemmPlan p = ops::plan(be, m, w);
    EXPECT_NE(p.describe().find("w4a16::gemm_fused"), std::string::npos) << p.describe();
    ops::w4a16_gemm(be, be.default_stream(), da, m, w, dc);
    std::vector<std::uint16_t> out(static_cast<std::size_t>(m * n));
    be.copy_d2h(out.data(), dc, out.size() * 2);
    const toolkit::GemmTolerance tol =
        toolkit::gemm_tolerance(ops::GemmRoute::kFused, WeightFormat::kNvfp4);
    const toolkit::Comparison c = toolkit::compare(out, toolkit::reference(a, m, hw, {}, tol));
    EXPECT_TRUE(toolkit::within(c, tol.normalized)) << c.str();
    be.free(da);
    be.free(dc);
  }
  ops::free_weights(be, w);
}

TEST(GemmRoutePolicy, TheFusedRouteRefusesSourceLayoutWeights) {
  CpuBackend be;
  const HostQuantWeights hw =
      toolkit::random_weights(WeightFormat::kNvfp4, 64, 128, testing::rng());
  ops::QuantWeights w = ops::upload_weights(be, hw);
  ops::GemmOptions o;
  o.route = ops::GemmRoute::kFused;
  const Error e = testing::expect_error([&] { (void)ops::plan(be, 64, w, o); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("the fused route reads weights in the decode layout"),
            std::string::npos)
      << e.what();
  ops::free_weights(be, w);
}

}  // namespace
}  // namespace metrale
