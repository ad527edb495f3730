// The launch trace on the CPU backend: with METRALE_TRACE set, every launch (at replay, for a
// captured one) becomes a complete event of Chrome trace JSON with its kernel, grid, block,
// shared memory, stream and host-clock times; a path that cannot be written is a warning at
// construction, and the backend runs untraced.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "core/log.h"
#include "metrale/cpu_backend.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/log_capture.h"
#include "support/trace_file.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;
using testing::LogCapture;
using testing::read_trace;
using testing::traced_launches;
using testing::TraceSwitch;

TEST(CpuLaunchTrace, EveryLaunchIsACompleteEventWithItsShapeAndTimes) {
  TraceSwitch trace;
  {
    CpuBackend b(CpuBackendOptions{.threads = 1});
    const StreamHandle s = b.create_stream();
    const DevicePtr p = b.alloc(4096 * 4), q = b.alloc(4096 * 4);
    ops::fill_u32(b, b.default_stream(), p, 4096, 7);
    ops::fill_u32(b, s, q, 4096, 0);
    ops::axpy_f32(b, s, q, p, 2.0f, 4096);
    b.synchronize(s);
    b.free(p);
    b.free(q);
    b.destroy_stream(s);
  }  // the file is written when the backend goes
  const nlohmann::json doc = read_trace(trace.path());
  const auto launches = traced_launches(doc);
  ASSERT_EQ(launches.size(), 3u) << doc.dump(1);
  EXPECT_EQ(launches[0]["name"], "core::fill_u32");
  EXPECT_EQ(launches[1]["name"], "core::fill_u32");
  EXPECT_EQ(launches[2]["name"], "core::axpy_f32");
  double last_start = -1;
  for (const auto& l : launches) {
    EXPECT_EQ(l["cat"], "launch");
    EXPECT_GE(l["ts"].get<double>(), last_start);  // one host thread: in launch order
    last_start = l["ts"].get<double>();
    EXPECT_GE(l["dur"].get<double>(), 0.0);
    ASSERT_EQ(l["args"]["grid"].size(), 3u);
    EXPECT_GE(l["args"]["grid"][0].get<unsigned>(), 1u);
    ASSERT_EQ(l["args"]["block"].size(), 3u);
    EXPECT_GE(l["args"]["block"][0].get<unsigned>(), 1u);
    EXPECT_TRUE(l["args"]["shared_bytes"].is_number());
    EXPECT_EQ(l["pid"], launches[0]["pid"]);
  }
  EXPECT_EQ(launches[0]["args"]["stream"], "0x1");    // the default stream
  EXPECT_NE(launches[1]["tid"], launches[0]["tid"]);  // another stream, another row
  EXPECT_EQ(launches[2]["tid"], launches[1]["tid"]);
  bool labelled = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") {
      labelled = e["args"]["name"].get<std::string>().starts_with("cpu backend #");
    }
  }
  EXPECT_TRUE(labelled) << doc.dump(1);
  EXPECT_EQ(doc["otherData"]["untraced_launches"], 0);
}

TEST(CpuLaunchTrace, ACapturedLaunchIsTracedAtEachReplayAndFlushWritesEarly) {
  TraceSwitch trace;
  CpuBackend b(CpuBackendOptions{.threads = 1});
  const StreamHandle s = b.create_stream();
  const DevicePtr p = b.alloc(256);
  b.op_cache().kernel(b, "core", "fill_u32");  // lookups before the capture
  b.begin_capture(s);
  ops::fill_u32(b, s, p, 64, 1);
  const GraphHandle g = b.end_capture(s);
  b.flush_trace();
  EXPECT_TRUE(traced_launches(read_trace(trace.path())).empty());  // captured, not run
  b.launch_graph(g, s);
  b.launch_graph(g, s);
  b.flush_trace();
  EXPECT_EQ(traced_launches(read_trace(trace.path())).size(), 2u);
  b.destroy_graph(g);
  b.free(p);
  b.destroy_stream(s);
}

TEST(CpuLaunchTrace, TwoBackendsShareTheProcessFileAsTwoRows) {
  TraceSwitch trace;
  {
    CpuBackend a(CpuBackendOptions{.threads = 1});
    CpuBackend b(CpuBackendOptions{.threads = 1});
    const DevicePtr pa = a.alloc(256), pb = b.alloc(256);
    ops::fill_u32(a, a.default_stream(), pa, 64, 1);
    ops::fill_u32(b, b.default_stream(), pb, 64, 1);
    a.free(pa);
    b.free(pb);
  }
  const auto launches = traced_launches(read_trace(trace.path()));
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_NE(launches[0]["pid"], launches[1]["pid"]);
}

TEST(CpuLaunchTrace, AnUnwritablePathIsAWarningNamingItAndTheBackendRunsUntraced) {
  const std::string bad = "/nonexistent-metrale-dir/trace.json";
  TraceSwitch trace(bad);
  LogCapture logs(log::Level::kWarn);
  CpuBackend b(CpuBackendOptions{.threads = 1});
  EXPECT_EQ(logs.count(log::Level::kWarn, "METRALE_TRACE=" + bad + ": cannot write the trace file"),
            1u);
  const DevicePtr p = b.alloc(256);
  ops::fill_u32(b, b.default_stream(), p, 64, 3);
  b.flush_trace();  // nothing to write, nothing thrown
  b.free(p);
  EXPECT_FALSE(std::filesystem::exists(bad));
}

}  // namespace
}  // namespace metrale
