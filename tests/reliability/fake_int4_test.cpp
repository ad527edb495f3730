// INT4 weights on the CUDA backend over the fake driver, whose w4a16 module publishes what the
// real one does: no entry reads INT4 yet (none publishes <entry>_int4), so the weights upload in
// their source layout and every route is refused by name before anything is launched, the
// automatic one included; nothing is left on the ledger.
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

TEST(FakeInt4, EveryRouteIsRefusedByNameAndNothingLaunches) {
  FakeProcess proc;
  std::unique_ptr<Backend> b = proc.make_backend();
  std::vector<float> wv(64 * 256, 0.25f);
  ops::QuantWeights w = ops::upload_weights(*b, quantize_int4(wv, 64, 256, 128, true, false),
                                            ops::UploadLayout::kBackendPreferred);
  EXPECT_EQ(w.packing, ops::WeightPacking::kSource);
  const std::size_t before = proc.fd.launches().size();
  const DevicePtr a = b->alloc(64 * 256 * 2), c = b->alloc(64 * 64 * 2);
  for (const ops::GemmRoute route :
       {ops::GemmRoute::kAuto, ops::GemmRoute::kDecode, ops::GemmRoute::kTiled}) {
    for (const std::int64_t m : {1, 64}) {
      const ops::GemmOptions o{ops::Activations::kExactBf16, route, DevicePtr{}};
      for (const auto& call : std::vector<std::function<void()>>{
               [&] { (void)ops::plan(*b, m, w, o); },
               [&] { ops::w4a16_gemm(*b, b->default_stream(), a, m, w, c, o); }}) {
        const Error e = expect_error(call);
        EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
        EXPECT_NE(std::string(e.what()).find("does not read int4 weights"), std::string::npos)
            << e.what();
      }
    }
  }
  EXPECT_EQ(proc.fd.launches().size(), before);
  b->free(a);
  b->free(c);
  ops::free_weights(*b, w);
  EXPECT_EQ(b->ledger_probe().live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale::testing::reliability
