// Lazy buffers on a real GPU's virtual memory: growth with a stable base, data kept, ops across
// physical allocations, a graph captured on the buffer replayed after it grew, and release back
// to zero. Skips, saying why, where no usable CUDA device is present.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/lazy_buffer.h"
#include "metrale/model_scope.h"
#include "metrale/ops/elementwise.h"
#include "metrale/runtime.h"

namespace metrale {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(GpuLazy, GrowsReplaysAndReleasesOnTheDevice) {
  std::unique_ptr<ModelScope> model;
  try {
    model = std::make_unique<ModelScope>(create_backend("cuda"));
  } catch (const Error& e) {
    GTEST_SKIP() << "no usable GPU: " << e.what();
  }
  Backend& b = model->backend();
  const std::size_t live0 = b.live_bytes();
  LazyBuffer buf = b.reserve_lazy(64 * kMiB, "gpu lazy");
  const std::size_t g = buf.granularity();
  ASSERT_GT(g, 0u);
  const DevicePtr base = buf.base();
  buf.grow(g);
  const StreamHandle s = b.create_stream();
  const std::size_t n = g / 4;  // the whole first granule
  ops::fill_u32(b, s, base, n, 11u);
  // Captured on the first granule; replayed after growth, the base has not moved.
  b.begin_capture(s);
  ops::fill_u32(b, s, base, 256, 22u);
  const GraphHandle graph = b.end_capture(s);
  buf.grow(5 * g);
  EXPECT_EQ(buf.base(), base);
  b.launch_graph(graph, s);
  const DevicePtr across = base.offset(g - 1024);  // into the second physical allocation
  ops::fill_u32(b, s, across, 1024, 33u);
  b.synchronize(s);
  std::vector<std::uint32_t> head(256), tail(1024);
  b.copy_d2h(head.data(), base, head.size() * 4);
  b.copy_d2h(tail.data(), across, tail.size() * 4);
  for (std::uint32_t v : head) ASSERT_EQ(v, 22u);
  for (std::uint32_t v : tail) ASSERT_EQ(v, 33u);
  std::uint32_t kept = 0;
  b.copy_d2h(&kept, base.offset(4096), 4);
  EXPECT_EQ(kept, 11u);
  EXPECT_EQ(b.live_bytes(), live0 + 5 * g);
  b.destroy_graph(graph);
  b.destroy_stream(s);
  buf.release();
  EXPECT_EQ(b.live_bytes(), live0);
}

}  // namespace
}  // namespace metrale
