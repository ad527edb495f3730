// The automatic route on the CPU backend never takes dequant → dense BF16: its dense GEMM is a
// plain reference, slower than its tiled kernel, so its dequant_bf16 publishes no smallest M
// (the CUDA side of the rule: tests/cuda/gemm_route_policy_test.cpp).
#include <gtest/gtest.h>

#include "metrale/cpu_backend.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "support/random.h"
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

}  // namespace
}  // namespace metrale
