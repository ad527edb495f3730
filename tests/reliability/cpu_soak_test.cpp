// Soak on the CPU backend: METRALE_SOAK_CYCLES (default 10,000) whole lifecycles, each verified,
// each leaving zero live bytes and zero streams, events and graphs, none warning; and the
// process's heap no larger after the last cycle than after the hundredth.
#include <gtest/gtest.h>

#include <memory>

#include "metrale/cpu_backend.h"
#include "reliability/lifecycle.h"
#include "reliability/soak.h"
#include "support/random.h"

namespace metrale::testing::reliability {
namespace {

TEST(CpuSoak, LoadRunTeardownCyclesComeBackToBaseline) {
  Hooks hooks;
  hooks.make_backend = [] {
    auto b = std::make_unique<CpuBackend>(CpuBackendOptions{.threads = 2});
    b->set_guard_bands(GuardBandConfig{});
    b->set_debug_sync(false);
    return std::unique_ptr<Backend>(std::move(b));
  };
  hooks.at_teardown = [](Backend& b) {
    const CpuBackend::HandleCounts c = dynamic_cast<CpuBackend&>(b).handle_counts();
    return c.streams + c.events + c.graphs;
  };
  run_soak("cpu", [&](std::size_t i) {
    const Outcome o = run_lifecycle(hooks, kSoakShapes, rng());
    ASSERT_TRUE(o.verified) << "cycle " << i << ": " << o.message();
    ASSERT_TRUE(o.teardown.clean()) << "cycle " << i;
    ASSERT_EQ(o.live_bytes_after, 0u) << "cycle " << i;
    ASSERT_EQ(o.live_allocs_after, 0u) << "cycle " << i;
    ASSERT_EQ(o.handles_at_teardown, 0u) << "cycle " << i << ": streams, events or graphs left";
  });
}

}  // namespace
}  // namespace metrale::testing::reliability
