// The launch trace on the CUDA backend (fake driver): with METRALE_TRACE set, each launch gets a
// timing event on each side and becomes a complete event timed by the fake's clock; a launch
// queued into a capture is counted, not timed; a failed timing call drops its launch, never the
// backend; the events are given back at destruction. Without the switch no event is made.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "cuda/rig.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/log_capture.h"
#include "support/trace_file.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::LogCapture;
using metrale::testing::read_trace;
using metrale::testing::traced_launches;
using metrale::testing::TraceSwitch;

TEST(CudaLaunchTrace, EachLaunchIsTimedByAnEventPair) {
  TraceSwitch trace;
  Rig rig;
  CudaBackend& b = rig.b();
  const DevicePtr p = b.alloc(4096 * 4);
  const std::uint64_t before = rig.fd.calls("cuEventRecord");
  ops::fill_u32(b, b.default_stream(), p, 4096, 7);
  rig.fd.advance_clock(5.0);  // the device idles 5 ms between the two launches
  ops::fill_u32(b, b.default_stream(), p, 4096, 8);
  // A reference event, then a pair per launch.
  EXPECT_EQ(rig.fd.calls("cuEventRecord") - before, 5u);
  b.free(p);
  rig.drop_all();
  EXPECT_EQ(rig.fd.outstanding().events, 0u);  // the trace's events were given back
  const nlohmann::json doc = read_trace(trace.path());
  const auto launches = traced_launches(doc);
  ASSERT_EQ(launches.size(), 2u) << doc.dump(1);
  for (const auto& l : launches) {
    EXPECT_EQ(l["name"], "core::fill_u32");
    EXPECT_NEAR(l["dur"].get<double>(), 1.0, 1e-3);  // the fake's launch: 0.001 ms
    EXPECT_EQ(l["args"]["grid"][0], 16);             // 4096 / the fake's tile of 256
    EXPECT_EQ(l["args"]["block"].size(), 3u);
  }
  // Start times keep the device's spacing: 1 us of the first launch, then 5 ms idle.
  EXPECT_NEAR(launches[1]["ts"].get<double>() - launches[0]["ts"].get<double>(), 5001.0, 0.5);
  EXPECT_TRUE(launches[0]["pid"].is_number());
  EXPECT_EQ(doc["otherData"]["untraced_launches"], 0);
}

TEST(CudaLaunchTrace, CapturedLaunchesAreCountedAndAFailedTimingDropsOnlyItsLaunch) {
  TraceSwitch trace;
  Rig rig;
  CudaBackend& b = rig.b();
  LogCapture logs(log::Level::kWarn);
  const DevicePtr p = b.alloc(1024);
  const StreamHandle s = b.create_stream();
  b.op_cache().kernel(b, "core", "fill_u32");
  b.begin_capture(s);
  ops::fill_u32(b, s, p, 256, 1);
  const GraphHandle g = b.end_capture(s);
  ops::fill_u32(b, s, p, 256, 2);
  ops::fill_u32(b, s, p, 256, 3);
  // The first elapsed-time call of the drain fails: that launch is dropped with a warning.
  rig.fd.fail_at("cuEventElapsedTime", rig.fd.calls("cuEventElapsedTime") + 1,
                 CUDA_ERROR_LAUNCH_FAILED);
  b.flush_trace();
  EXPECT_EQ(logs.count(log::Level::kWarn, "METRALE_TRACE: cuEventElapsedTime failed"), 1u);
  const nlohmann::json doc = read_trace(trace.path());
  EXPECT_EQ(traced_launches(doc).size(), 1u) << doc.dump(1);
  EXPECT_EQ(doc["otherData"]["untraced_launches"], 2);  // the captured one and the failed one
  b.destroy_graph(g);
  b.destroy_stream(s);
  b.free(p);
}

TEST(CudaLaunchTrace, NoEventIsMadeWithoutTheSwitch) {
  unsetenv("METRALE_TRACE");
  Rig rig;
  CudaBackend& b = rig.b();
  const DevicePtr p = b.alloc(1024);
  const std::uint64_t created = rig.fd.calls("cuEventCreate");
  ops::fill_u32(b, b.default_stream(), p, 256, 1);
  EXPECT_EQ(rig.fd.calls("cuEventCreate"), created);
  EXPECT_EQ(rig.fd.calls("cuEventRecord"), 0u);
  b.free(p);
}

}  // namespace
}  // namespace metrale::cuda::testing
