// The stream pool's cross-stream rule (src/core/stream_pool.cpp) on the fake driver, whose
// events can be held not done (FakeDriver::hold_events): a block freed on one stream is reused
// by another only once the free's event has completed, and before refusing for lack of memory
// the pool waits for the other streams' pending frees. On the CPU backend every event is done
// when recorded, so neither half of the rule is exercised there.
#include <gtest/gtest.h>

#include <cstddef>

#include "cuda/rig.h"
#include "metrale/lazy_buffer.h"
#include "metrale/stream_pool.h"

namespace metrale::cuda::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// The fake's pool granularity, read from a pool made and released for it.
std::size_t granularity_of(CudaBackend& b) {
  StreamPool probe(b, b.reserve_lazy(64 * kMiB, "probe"));
  const std::size_t g = probe.granularity();
  probe.release();
  return g;
}

TEST(StreamPoolEvents, AnotherStreamReusesAFreeOnlyOnceItsEventIsDone) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s1 = b.create_stream(), s2 = b.create_stream();
  {
    StreamPool pool(b, b.reserve_lazy(64 * kMiB, "events pool"));
    rig.fd.hold_events(true);
    const DevicePtr a = pool.allocate(4096, s1);
    pool.free(a, s1);  // s1's work on `a` is still queued: the free's event is not done
    const DevicePtr early = pool.allocate(4096, s2);
    EXPECT_NE(early, a) << "s2 was handed a block s1's queued work may still be using";
    // The free's own stream may take it back at once: stream order protects it.
    const DevicePtr own = pool.allocate(4096, s1);
    EXPECT_EQ(own, a);
    pool.free(own, s1);
    rig.fd.release_events();  // s1's work has run
    const DevicePtr later = pool.allocate(4096, s2);
    EXPECT_EQ(later, a) << "a completed free is reusable by every stream";
    EXPECT_GE(pool.stats().reuses, 2u);
    pool.free(early, s2);
    pool.free(later, s2);
    rig.fd.hold_events(false);
    pool.release();
  }
  b.destroy_stream(s1);
  b.destroy_stream(s2);
}

TEST(StreamPoolEvents, OutOfBudgetWaitsForAnotherStreamsPendingFree) {
  Rig rig;
  CudaBackend& b = rig.b();
  const std::size_t g = granularity_of(b);
  const StreamHandle s1 = b.create_stream(), s2 = b.create_stream();
  {
    // Room for exactly one granule: a second block fits only in the first one's place.
    StreamPool pool(b, b.reserve_lazy(g, "one granule"));
    rig.fd.hold_events(true);
    const DevicePtr a = pool.allocate(g, s1);
    pool.free(a, s1);
    const std::uint64_t waits = rig.fd.calls("cuEventSynchronize");
    const DevicePtr c = pool.allocate(g, s2);  // must wait for s1's free, not refuse
    EXPECT_EQ(c, a);
    EXPECT_GT(rig.fd.calls("cuEventSynchronize"), waits) << "reused without waiting";
    EXPECT_EQ(pool.stats().grows, 1u);
    pool.free(c, s2);
    rig.fd.hold_events(false);
    pool.release();
  }
  b.destroy_stream(s1);
  b.destroy_stream(s2);
}

}  // namespace
}  // namespace metrale::cuda::testing
