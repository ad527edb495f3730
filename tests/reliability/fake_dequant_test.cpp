// The dequant route on the CUDA backend over the fake driver: where the backend has no dense BF16
// GEMM (no cuBLASLt), every entry point refuses the route as unavailable, naming the backend's
// reason, before anything is launched; where it has one, the route is planned with its dequant
// launch and the backend's dense plan.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/error.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "reliability/fake_model.h"

namespace metrale::testing::reliability {
namespace {

TEST(FakeDequantRoute, IsUnavailableWithoutADenseGemmAndNeverLaunches) {
  FakeProcess proc;
  std::unique_ptr<Backend> b = proc.make_backend();
  std::vector<float> wv(64 * 128, 0.25f);
  ops::QuantWeights w = ops::upload_weights(*b, quantize_nvfp4(wv, 64, 128));
  const ops::GemmOptions o{ops::Activations::kExactBf16, ops::GemmRoute::kDequant, DevicePtr{}};
  const std::string why = b->dense_gemm_unavailable(DenseKind::kBf16);
  if (why.empty()) {
    const ops::GemmPlan p = ops::plan(*b, 64, w, o);
    EXPECT_EQ(p.launches.size(), 1u);
    EXPECT_TRUE(p.dense.has_value());
  } else {
    const std::size_t before = proc.fd.launches().size();
    const DevicePtr a = b->alloc(64 * 128 * 2), c = b->alloc(64 * 64 * 2);
    for (const auto& call : std::vector<std::function<void()>>{
             [&] { (void)ops::plan(*b, 64, w, o); }, [&] { (void)ops::choose_route(*b, 64, w, o); },
             [&] { ops::w4a16_gemm(*b, b->default_stream(), a, 64, w, c, o); }}) {
      const Error e = expect_error(call);
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
    EXPECT_EQ(proc.fd.launches().size(), before);
    b->free(a);
    b->free(c);
  }
  ops::free_weights(*b, w);
}

}  // namespace
}  // namespace metrale::testing::reliability
