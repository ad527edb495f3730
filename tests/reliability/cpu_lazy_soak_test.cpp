// Lazy-buffer soak on the CPU backend (reliability/lazy_soak.h): every cycle gives back all it
// mapped and reserved, with no warning.
#include <gtest/gtest.h>

#include "metrale/cpu_backend.h"
#include "reliability/lazy_soak.h"

namespace metrale::testing::reliability {
namespace {

TEST(CpuLazySoak, GrowReleaseCyclesComeBackToZero) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  run_lazy_soak("cpu", b, [](std::size_t) {});
}

}  // namespace
}  // namespace metrale::testing::reliability
