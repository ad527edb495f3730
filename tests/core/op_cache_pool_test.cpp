// The OpCache's stream-ordered scratch (OpCache::scratch with a stream) on the CPU backend: its
// blocks come from one lazy buffer, a grown tag hands its old block back for the next request,
// the pool's figures join alloc_stats, METRALE_SCRATCH_POOL_MB turns it off or bounds it (then
// scratch falls back to plain allocations with one warning), and release leaves nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>

#include "metrale/cpu_backend.h"
#include "metrale/ledger.h"
#include "metrale/op_cache.h"
#include "support/log_capture.h"
#include "support/scoped_env.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;
using testing::LogCapture;

constexpr std::size_t kMiB = std::size_t{1} << 20;

using testing::ScopedEnv;

std::unique_ptr<CpuBackend> cpu() {
  return std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
}

TEST(OpCachePool, StreamScratchComesFromOneLazyBufferAndGrowthReusesIt) {
  auto b = cpu();
  OpCache& c = b->op_cache();
  EXPECT_EQ(c.pool_summary(), "not used yet");
  const StreamHandle s = b->default_stream();
  const DevicePtr small = c.scratch(*b, "a", 4096, s);
  const DevicePtr other = c.scratch(*b, "b", 8192, s);
  // One ledger entry (the pool's buffer) for both blocks, on its lazy kind.
  EXPECT_EQ(b->alloc_stats().current_count, 1u);
  EXPECT_THAT(b->alloc_report(), HasSubstr("op_cache"));
  EXPECT_EQ(c.scratch(*b, "a", 1024, s), small);  // fits: the same block
  // Growing "a" hands its 4 KiB back to the pool in stream order; "c" of that size reuses it.
  const DevicePtr grown = c.scratch(*b, "a", 64 * 1024, s);
  EXPECT_NE(grown, small);
  EXPECT_EQ(c.scratch(*b, "c", 4096, s), small);
  EXPECT_EQ(c.retired_scratch_count(), 0u);
  const AllocStats st = b->alloc_stats();
  EXPECT_EQ(st.scratch_pool.allocations, 4u);
  EXPECT_EQ(st.scratch_pool.grows, 1u);  // one granule held all four
  EXPECT_EQ(st.scratch_pool.reuses, 3u);
  EXPECT_EQ(st.scratch_pool.current_bytes, 64 * 1024 + 8192 + 4096u);
  EXPECT_EQ(st.current_count, 1u);
  EXPECT_THAT(c.pool_summary(), HasSubstr("in use"));
  (void)other;
  c.release(*b);
  EXPECT_EQ(b->live_bytes(), 0u);
  EXPECT_EQ(b->alloc_stats().scratch_pool.reserved_bytes, 0u);
  c.release(*b);  // a second release does nothing
}

TEST(OpCachePool, TheSwitchTurnsThePoolOff) {
  const ScopedEnv off("METRALE_SCRATCH_POOL_MB", "0");
  auto b = cpu();
  OpCache& c = b->op_cache();
  (void)c.scratch(*b, "a", 4096, b->default_stream());
  (void)c.scratch(*b, "a", 8192, b->default_stream());
  EXPECT_EQ(c.pool_summary(), "off (METRALE_SCRATCH_POOL_MB=0)");
  EXPECT_EQ(b->alloc_stats().scratch_pool.allocations, 0u);
  EXPECT_EQ(c.retired_scratch_count(), 1u);  // the plain path's retirement
  c.release(*b);
  EXPECT_EQ(b->live_bytes(), 0u);
}

TEST(OpCachePool, AFullPoolFallsBackToPlainScratchWithOneWarning) {
  const ScopedEnv small("METRALE_SCRATCH_POOL_MB", "2");
  auto b = cpu();
  OpCache& c = b->op_cache();
  LogCapture logs(log::Level::kWarn);
  const StreamHandle s = b->default_stream();
  (void)c.scratch(*b, "a", kMiB, s);
  const DevicePtr big = c.scratch(*b, "b", 3 * kMiB, s);  // past the 2 MiB budget
  const DevicePtr big2 = c.scratch(*b, "c", 3 * kMiB, s);
  EXPECT_TRUE(big);
  EXPECT_TRUE(big2);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocated outside the pool"), 1u);
  EXPECT_EQ(b->alloc_stats().current_count, 3u);  // the pool's buffer and two plain blocks
  c.release(*b);
  EXPECT_EQ(b->live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale
