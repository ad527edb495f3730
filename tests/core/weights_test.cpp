// The managed-memory fallback policy of alloc_weights (docs/CONTRACT.md, allocation fallback) on
// the CPU backend, whose fault injection caps device allocations but not managed ones.
#include "metrale/weights.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "support/log_capture.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kCap = 1 << 20;

std::unique_ptr<CpuBackend> capped_backend() {
  auto b = std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
  CpuFaults f;
  f.max_device_alloc = kCap;
  b->set_faults(f);
  return b;
}

TEST(AllocWeights, FitsInDeviceMemoryWithoutFallingBack) {
  auto b = capped_backend();
  testing::LogCapture logs;
  const DevicePtr p = alloc_weights(*b, kCap / 2);
  EXPECT_FALSE(b->op_cache().alloc_fell_back());
  EXPECT_EQ(logs.count(log::Level::kWarn, "managed"), 0u);
  const auto entries = b->ledger_probe().stats();
  EXPECT_EQ(entries.current_count, 1u);
  b->free(p);
}

TEST(AllocWeights, OutOfMemoryWarnsOnceLatchesAndUsesManagedMemory) {
  auto b = capped_backend();
  testing::LogCapture logs;
  const DevicePtr big = alloc_weights(*b, 2 * kCap);  // over the cap: falls back
  EXPECT_TRUE(b->op_cache().alloc_fell_back());
  EXPECT_EQ(logs.count(log::Level::kWarn, "managed memory from now on"), 1u);
  // Latched: even an allocation that would fit goes to managed memory, with no new warning.
  const DevicePtr small = alloc_weights(*b, 64);
  EXPECT_EQ(logs.count(log::Level::kWarn, "managed memory from now on"), 1u);
  const std::string report = b->alloc_report();
  EXPECT_EQ(b->live_alloc_count(), 2u);
  EXPECT_THAT(report, HasSubstr("weights_test.cpp"));  // the caller's site, not the helper's
  b->free(big);
  b->free(small);
  EXPECT_EQ(b->live_bytes(), 0u);
}

TEST(AllocWeights, TheNextModelTriesDeviceMemoryAgain) {
  {
    auto first = capped_backend();
    const DevicePtr p = alloc_weights(*first, 2 * kCap);
    EXPECT_TRUE(first->op_cache().alloc_fell_back());
    first->free(p);
  }
  auto second = capped_backend();
  EXPECT_FALSE(second->op_cache().alloc_fell_back());
  const DevicePtr q = alloc_weights(*second, 16);
  EXPECT_FALSE(second->op_cache().alloc_fell_back());
  second->free(q);
}

TEST(AllocWeights, OtherErrorsAreNotTurnedIntoAFallback) {
  auto b = capped_backend();
  const Error e = testing::expect_error([&] { alloc_weights(*b, 0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[alloc]"));
  EXPECT_FALSE(b->op_cache().alloc_fell_back());
}

}  // namespace
}  // namespace metrale
