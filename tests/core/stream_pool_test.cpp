// The stream-ordered pool (metrale/stream_pool.h) on the CPU backend's lazy buffers: reuse in
// stream order, growth only when nothing fits, a stable base, merged free runs and the
// fragmentation figure, every refusal with its message and the block left as it was, ops on pool
// memory, release, and a soak of 10,000 cycles back to 0 bytes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/lazy_buffer.h"
#include "metrale/ops/elementwise.h"
#include "metrale/stream_pool.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;

constexpr std::size_t kMiB = std::size_t{1} << 20;

struct Rig {
  std::unique_ptr<CpuBackend> backend =
      std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
  std::size_t live_before = backend->live_bytes();
  StreamPool pool{*backend, backend->reserve_lazy(64 * kMiB, "test pool")};
  StreamHandle s0 = backend->default_stream();
};

std::size_t offset_of(const StreamPool& pool, DevicePtr p) {
  return static_cast<std::size_t>(p.address() - pool.base().address());
}

TEST(StreamPool, AFreedBlockIsReusedByItsStreamWithoutGrowing) {
  Rig r;
  const DevicePtr a = r.pool.allocate(1000, r.s0);
  EXPECT_EQ(a.address() % StreamPool::kAlign, 0u);
  EXPECT_EQ(offset_of(r.pool, a), 0u);
  PoolStats s = r.pool.stats();
  EXPECT_EQ(s.current_bytes, 1024u);  // rounded up to 256
  EXPECT_EQ(s.grows, 1u);
  EXPECT_EQ(s.reserved_bytes, r.pool.granularity());
  r.pool.free(a, r.s0);
  const DevicePtr b = r.pool.allocate(900, r.s0);
  EXPECT_EQ(b, a);
  s = r.pool.stats();
  EXPECT_EQ(s.reuses, 1u);
  EXPECT_EQ(s.grows, 1u);
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_EQ(s.peak_bytes, 1024u);
}

TEST(StreamPool, GrowsOnlyWhenNothingFitsAndTheBaseNeverMoves) {
  Rig r;
  const std::size_t g = r.pool.granularity();
  const DevicePtr base = r.pool.base();
  const DevicePtr first = r.pool.allocate(4096, r.s0);
  r.backend->copy_h2d(first, std::vector<std::uint8_t>(4096, 0x5A).data(), 4096);
  // The rest of the first granule serves without growth.
  const DevicePtr second = r.pool.allocate(g - 4096, r.s0);
  EXPECT_EQ(r.pool.stats().grows, 1u);
  EXPECT_EQ(offset_of(r.pool, second), 4096u);
  // A block past it grows the buffer, at the top, and the base stays put.
  const DevicePtr third = r.pool.allocate(3 * kMiB, r.s0);
  EXPECT_EQ(offset_of(r.pool, third), g);
  EXPECT_EQ(r.pool.stats().grows, 2u);
  EXPECT_EQ(r.pool.base(), base);
  std::vector<std::uint8_t> back(4096);
  r.backend->copy_d2h(back.data(), first, back.size());
  EXPECT_EQ(back, std::vector<std::uint8_t>(4096, 0x5A));
  EXPECT_EQ(r.pool.stats().reserved_bytes, g + ((3 * kMiB + g - 1) / g) * g);
}

TEST(StreamPool, AnotherStreamReusesABlockOnceItsFreeEventCompleted) {
  Rig r;
  const StreamHandle s1 = r.backend->create_stream();
  const DevicePtr a = r.pool.allocate(8192, s1);
  r.pool.free(a, s1);
  // The CPU backend's work runs as it is queued, so the free's event is complete at once.
  const DevicePtr b = r.pool.allocate(8192, r.s0);
  EXPECT_EQ(b, a);
  r.pool.free(b, r.s0);
  r.backend->destroy_stream(s1);
}

TEST(StreamPool, FreeRunsMergeAndFragmentationSaysHowSplinteredTheyAre) {
  Rig r;
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(r.pool.allocate(kMiB / 4, r.s0));
  const std::size_t tail = r.pool.granularity() - kMiB;  // the granule's rest, free
  // Free blocks 0 and 2: two runs of 256 KiB and the tail.
  r.pool.free(blocks[0], r.s0);
  r.pool.free(blocks[2], r.s0);
  (void)r.pool.allocate(256, r.s0);  // reaps the frees; takes 256 B of one run
  PoolStats s = r.pool.stats();
  EXPECT_EQ(s.free_bytes, kMiB / 2 - 256 + tail);
  EXPECT_EQ(s.largest_free_bytes, tail);
  EXPECT_NEAR(s.fragmentation(),
              1.0 - static_cast<double>(tail) / static_cast<double>(s.free_bytes), 1e-12);
  // Freeing block 3 joins block 2's run and the tail into one; the next small block comes from
  // the smallest run that fits (block 0's rest), not from the big one.
  r.pool.free(blocks[3], r.s0);
  (void)r.pool.allocate(256, r.s0);
  s = r.pool.stats();
  EXPECT_EQ(s.largest_free_bytes, kMiB / 4 + kMiB / 4 + tail);
  EXPECT_EQ(s.free_bytes, kMiB / 4 - 512 + kMiB / 2 + tail);
}

TEST(StreamPool, OpsRunOnPoolMemory) {
  Rig r;
  const std::size_t n = 100'003;
  const DevicePtr p = r.pool.allocate(n * 4, r.s0);
  ops::fill_u32(*r.backend, r.s0, p, n, 0xC0FFEEu);
  std::vector<std::uint32_t> out(n);
  r.backend->copy_d2h(out.data(), p, n * 4);
  EXPECT_EQ(out, std::vector<std::uint32_t>(n, 0xC0FFEEu));
}

TEST(StreamPool, RefusalsNameTheCallAndLeaveThePoolAsItWas) {
  Rig r;
  const DevicePtr a = r.pool.allocate(4096, r.s0);
  const PoolStats before = r.pool.stats();
  Error e = expect_error([&] { (void)r.pool.allocate(0, r.s0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[StreamPool::allocate] a request of 0 bytes"));
  e = expect_error([&] { (void)r.pool.allocate(65 * kMiB, r.s0); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("exceed the pool 'test pool''s budget"));
  // Within the budget but past what is left of it.
  const DevicePtr big = r.pool.allocate(60 * kMiB, r.s0);
  e = expect_error([&] { (void)r.pool.allocate(4 * kMiB, r.s0); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  r.pool.free(big, r.s0);
  e = expect_error([&] { r.pool.free(DevicePtr(r.pool.base().address() + 256), r.s0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("is not a block of the pool 'test pool'"));
  e = expect_error([&] { r.pool.free(big, r.s0); });  // handed back already
  EXPECT_THAT(e.what(), HasSubstr("handed back already"));
  // A free while the stream captures would put its event into the graph.
  const StreamHandle s1 = r.backend->create_stream();
  r.backend->begin_capture(s1);
  e = expect_error([&] { r.pool.free(a, s1); });
  EXPECT_EQ(e.code(), ErrorCode::kCapture);
  r.backend->abort_capture(s1);
  r.backend->destroy_stream(s1);
  EXPECT_EQ(r.pool.stats().current_bytes, before.current_bytes);
  r.pool.free(a, r.s0);  // still allocated: the refused free changed nothing
}

TEST(StreamPool, ReleaseGivesEverythingBackOnce) {
  Rig r;
  (void)r.pool.allocate(3 * kMiB, r.s0);
  EXPECT_GT(r.backend->live_bytes(), r.live_before);
  r.pool.release();
  EXPECT_EQ(r.backend->live_bytes(), r.live_before);
  EXPECT_EQ(r.pool.stats().reserved_bytes, 0u);
  Error e = expect_error([&] { r.pool.release(); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[StreamPool::release]"));
  e = expect_error([&] { (void)r.pool.allocate(16, r.s0); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
}

TEST(StreamPool, TenThousandCyclesOnTwoStreamsEndAtZeroBytes) {
  Rig r;
  const StreamHandle s1 = r.backend->create_stream();
  std::mt19937_64 gen(42);
  std::uniform_int_distribution<std::size_t> size(1, 512 * 1024);
  std::vector<std::pair<DevicePtr, StreamHandle>> live;
  for (int i = 0; i < 10'000; ++i) {
    const StreamHandle s = (gen() & 1) ? s1 : r.s0;
    live.emplace_back(r.pool.allocate(size(gen), s), s);
    if (live.size() > 8 || (gen() & 3) == 0) {
      const std::size_t k = gen() % live.size();
      r.pool.free(live[k].first, live[k].second);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  for (const auto& [p, s] : live) r.pool.free(p, s);
  const PoolStats s = r.pool.stats();
  EXPECT_EQ(s.current_bytes, 0u);
  EXPECT_LE(s.reserved_bytes, 16 * kMiB);  // 9 blocks of 512 KiB at most live at once
  EXPECT_GT(s.reuses, 9'000u);
  r.pool.release();
  r.backend->destroy_stream(s1);
  EXPECT_EQ(r.backend->live_bytes(), r.live_before);
  EXPECT_EQ(r.backend->handle_counts().events, 0u);
}

}  // namespace
}  // namespace metrale
