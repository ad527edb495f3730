// Soak on the CPU backend: METRALE_SOAK_CYCLES (default 10,000) whole lifecycles, each verified,
// each leaving zero live bytes and zero streams, events and graphs, none warning; and the
// process's heap no larger after the last cycle than after the hundredth.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>

#include "metrale/cpu_backend.h"
#include "reliability/lifecycle.h"
#include "reliability/soak.h"
#include "support/log_capture.h"
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
  const std::size_t cycles = soak_cycles();
  const std::size_t warm = std::min<std::size_t>(cycles, 100);
  std::size_t heap_warm = 0;
  LogCapture logs(log::Level::kWarn);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 1; i <= cycles; ++i) {
    const Outcome o = run_lifecycle(hooks, kSoakShapes, rng());
    ASSERT_TRUE(o.verified) << "cycle " << i << ": " << o.message();
    ASSERT_TRUE(o.teardown.clean()) << "cycle " << i;
    ASSERT_EQ(o.live_bytes_after, 0u) << "cycle " << i;
    ASSERT_EQ(o.live_allocs_after, 0u) << "cycle " << i;
    ASSERT_EQ(o.handles_at_teardown, 0u) << "cycle " << i << ": streams, events or graphs left";
    if (i == warm) heap_warm = heap_in_use();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(heap_in_use(), heap_warm + kHeapSlack) << "the heap grew after cycle " << warm;
  EXPECT_TRUE(logs.lines().empty()) << logs.lines().front().text;
  std::cout << fmt::format("soak cpu: {} cycles in {:.1f} s ({:.2f} ms per cycle)\n", cycles, secs,
                           1e3 * secs / static_cast<double>(cycles));
}

}  // namespace
}  // namespace metrale::testing::reliability
