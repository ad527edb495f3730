// Soak on a real GPU: METRALE_GPU_SOAK_CYCLES (default 200) whole lifecycles
// (tests/reliability/lifecycle.h) on the CUDA backend, each verified against float64, each
// leaving zero live bytes on the ledger, and the driver's free memory back where it was after
// the first cycle. Skips, saying why, where no usable CUDA device is present;
// scripts/device-check.sh runs it on an H100/H200.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <random>

#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/runtime.h"
#include "reliability/lifecycle.h"
#include "reliability/soak.h"

namespace metrale {
namespace {

using testing::reliability::Hooks;
using testing::reliability::Outcome;

// The driver may round what it reports to its 2 MiB pages and keep a little for itself (module
// loads, graph executables); a leak of one buffer per cycle would exceed this within cycles.
constexpr std::size_t kFreeSlack = std::size_t{32} << 20;

TEST(GpuSoak, LoadRunTeardownCyclesComeBackToBaseline) {
  // A model of its own that lives through the soak, only to ask the driver for free memory.
  std::unique_ptr<ModelScope> observer;
  try {
    observer = std::make_unique<ModelScope>(create_backend("cuda"));
  } catch (const Error& e) {
    GTEST_SKIP() << "no usable GPU: " << e.what();
  }
  Backend& probe = observer->backend();
  const Hooks hooks{[] { return create_backend("cuda"); }, nullptr};
  const std::size_t cycles = testing::reliability::soak_cycles("METRALE_GPU_SOAK_CYCLES", 200);
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  std::size_t baseline = 0, lowest = SIZE_MAX;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 1; i <= cycles; ++i) {
    const Outcome o =
        testing::reliability::run_lifecycle(hooks, testing::reliability::Shapes{}, gen);
    ASSERT_TRUE(o.verified) << "cycle " << i << ": " << o.message();
    ASSERT_TRUE(o.teardown.clean()) << "cycle " << i;
    ASSERT_EQ(o.live_bytes_after, 0u) << "cycle " << i;
    ASSERT_EQ(o.live_allocs_after, 0u) << "cycle " << i;
    const std::size_t free = probe.driver_free_memory();
    if (i == 1) baseline = free;
    lowest = std::min(lowest, free);
    ASSERT_GE(free + kFreeSlack, baseline)
        << "cycle " << i << ": the device has " << (baseline - free) << " bytes less free memory "
        << "than after cycle 1";
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << fmt::format(
      "soak gpu ({}): {} cycles in {:.1f} s ({:.1f} ms per cycle); free memory after cycle 1 "
      "{:.1f} MiB, lowest {:.1f} MiB\n",
      probe.device_name(), cycles, secs, 1e3 * secs / static_cast<double>(cycles),
      static_cast<double>(baseline) / (1 << 20), static_cast<double>(lowest) / (1 << 20));
}

}  // namespace
}  // namespace metrale
