// Soak on the fake CUDA driver: METRALE_SOAK_CYCLES (default 10,000) whole lifecycles, each
// from driver discovery to the drop of backend, registry and host, each verified, each leaving
// zero live bytes on the ledger and nothing in the driver, none warning; and the process's heap
// no larger after the last cycle than after the hundredth. Each cycle gets a fresh fake (the fake
// records every launch, which would read as heap growth); what it checks is what the runtime
// leaves behind, which a longer-lived driver would only accumulate.
#include <gtest/gtest.h>

#include "reliability/fake_model.h"
#include "reliability/lifecycle.h"
#include "reliability/soak.h"
#include "support/random.h"

namespace metrale::testing::reliability {
namespace {

TEST(FakeSoak, LoadRunTeardownCyclesComeBackToBaseline) {
  run_soak("fake driver", [&](std::size_t i) {
    FakeProcess p;
    const Outcome o =
        run_lifecycle(Hooks{[&p] { return p.make_backend(); }, nullptr}, kSoakShapes, rng());
    ASSERT_TRUE(o.verified) << "cycle " << i << ": " << o.message();
    ASSERT_TRUE(o.teardown.clean()) << "cycle " << i;
    ASSERT_EQ(o.live_bytes_after, 0u) << "cycle " << i;
    ASSERT_EQ(o.live_allocs_after, 0u) << "cycle " << i;
    ASSERT_TRUE(p.fd.outstanding().none()) << "cycle " << i << ": the driver still holds something";
  });
}

}  // namespace
}  // namespace metrale::testing::reliability
