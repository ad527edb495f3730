// Soak on the fake CUDA driver: METRALE_SOAK_CYCLES (default 10,000) whole lifecycles, each
// from driver discovery to the drop of backend, registry and host, each verified, each leaving
// zero live bytes on the ledger and nothing in the driver, none warning; and the process's heap
// no larger after the last cycle than after the hundredth. Each cycle gets a fresh fake (the fake
// records every launch, which would read as heap growth); what it checks is what the runtime
// leaves behind, which a longer-lived driver would only accumulate.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "reliability/fake_model.h"
#include "reliability/lifecycle.h"
#include "reliability/soak.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale::testing::reliability {
namespace {

TEST(FakeSoak, LoadRunTeardownCyclesComeBackToBaseline) {
  const std::size_t cycles = soak_cycles();
  const std::size_t warm = std::min<std::size_t>(cycles, 100);
  std::size_t heap_warm = 0;
  LogCapture logs(log::Level::kWarn);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 1; i <= cycles; ++i) {
    FakeProcess p;
    const Outcome o =
        run_lifecycle(Hooks{[&p] { return p.make_backend(); }, nullptr}, kSoakShapes, rng());
    ASSERT_TRUE(o.verified) << "cycle " << i << ": " << o.message();
    ASSERT_TRUE(o.teardown.clean()) << "cycle " << i;
    ASSERT_EQ(o.live_bytes_after, 0u) << "cycle " << i;
    ASSERT_EQ(o.live_allocs_after, 0u) << "cycle " << i;
    ASSERT_TRUE(p.fd.outstanding().none()) << "cycle " << i << ": the driver still holds something";
    if (i == warm) heap_warm = heap_in_use();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(heap_in_use(), heap_warm + kHeapSlack) << "the heap grew after cycle " << warm;
  EXPECT_TRUE(logs.lines().empty()) << logs.lines().front().text;
  std::cout << fmt::format("soak fake driver: {} cycles in {:.1f} s ({:.2f} ms per cycle)\n",
                           cycles, secs, 1e3 * secs / static_cast<double>(cycles));
}

}  // namespace
}  // namespace metrale::testing::reliability
