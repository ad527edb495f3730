// METRALE_DEBUG_SYNC_KERNELS, read by every backend at construction: 0 and 1 are taken silently,
// any other value is named in a warning with the accepted values (as METRALE_REDZONE* and
// METRALE_LOG do), so a typo does not go unnoticed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "metrale/cpu_backend.h"
#include "support/log_capture.h"

namespace metrale {
namespace {

// Sets the variable for one test and restores "unset" afterwards.
class DebugSyncEnv : public ::testing::Test {
 protected:
  void SetUp() override { unsetenv("METRALE_DEBUG_SYNC_KERNELS"); }
  void TearDown() override { unsetenv("METRALE_DEBUG_SYNC_KERNELS"); }
  // Whether a backend made with the variable set to value (null: unset) syncs after launches.
  static bool debug_sync_with(const char* value) {
    if (value) setenv("METRALE_DEBUG_SYNC_KERNELS", value, 1);
    const CpuBackend backend(CpuBackendOptions{builtin_host_modules(), 1});
    return backend.debug_sync();
  }
};

TEST_F(DebugSyncEnv, AcceptedValuesAreSilent) {
  testing::LogCapture logs;
  EXPECT_FALSE(debug_sync_with(nullptr));
  EXPECT_FALSE(debug_sync_with(""));
  EXPECT_FALSE(debug_sync_with("0"));
  EXPECT_TRUE(debug_sync_with("1"));
  EXPECT_EQ(logs.count(log::Level::kWarn, "METRALE_DEBUG_SYNC_KERNELS"), 0u);
}

TEST_F(DebugSyncEnv, AnUnknownValueIsNamedInAWarning) {
  for (const char* value : {"yes", "2", "on ", "true"}) {
    testing::LogCapture logs;
    // Taken as on, as before the warning existed: a user who asked for syncs still gets them.
    EXPECT_TRUE(debug_sync_with(value)) << value;
    EXPECT_EQ(logs.count(log::Level::kWarn, std::string("METRALE_DEBUG_SYNC_KERNELS=") + value +
                                                " is not one of 0, 1"),
              1u)
        << value;
  }
}

}  // namespace
}  // namespace metrale
