// Lazy-buffer soak on the fake driver (reliability/lazy_soak.h): every cycle ends with no
// reservation, physical allocation or mapping left in the driver and no byte on the ledger.
#include <gtest/gtest.h>

#include "cuda/rig.h"
#include "reliability/lazy_soak.h"

namespace metrale::testing::reliability {
namespace {

TEST(FakeLazySoak, GrowReleaseCyclesLeaveNoHandles) {
  cuda::testing::Rig rig;
  run_lazy_soak("fake", rig.b(), [&](std::size_t i) {
    const cuda::testing::FakeOutstanding o = rig.fd.outstanding();
    ASSERT_EQ(o.reservations + o.vmm_handles + o.mappings, 0u) << "cycle " << i;
  });
}

}  // namespace
}  // namespace metrale::testing::reliability
