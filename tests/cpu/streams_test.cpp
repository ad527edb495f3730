// CPU backend streams, events and graphs: in-order work, handle lifetimes, capture that records
// instead of running, replay, invalidation, and kernel lookups during a capture.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/read_back.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using testing::read;

template <class T>
DevicePtr upload(Backend& b, const std::vector<T>& v) {
  const DevicePtr p = b.alloc(v.size() * sizeof(T));
  b.copy_h2d(p, v.data(), v.size() * sizeof(T));
  return p;
}

TEST(CpuStreams, WorkOnAStreamRunsInOrder) {
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  constexpr std::size_t n = 3000;
  std::vector<float> host(n), x(n);
  for (std::size_t i = 0; i < n; ++i) {
    host[i] = static_cast<float>(i);
    x[i] = static_cast<float>(i % 7);
  }
  const DevicePtr a = b.alloc(n * 4);
  const DevicePtr y = b.alloc(n * 4);
  const DevicePtr xd = upload(b, x);
  // memset → copy → copy → launch: the launch must see the copied values, not the memset.
  b.memset_async(a, 0xFF, n * 4, s);
  b.copy_h2d_async(a, host.data(), n * 4, s);
  b.copy_d2d_async(y, a, n * 4, s);
  ops::axpy_f32(b, s, y, xd, 2.0f, n);
  std::vector<float> got(n);
  b.copy_d2h_after(got.data(), y, n * 4, s);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], host[i] + 2.0f * x[i]) << i;
  b.synchronize(s);
  b.synchronize_device();
  b.destroy_stream(s);
  b.free(a);
  b.free(y);
  b.free(xd);
}

TEST(CpuStreams, EventsAreDoneOnceRecordedAndUnknownHandlesAreRejected) {
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  const EventHandle e = b.create_event();
  EXPECT_TRUE(e);
  const DevicePtr p = b.alloc(64);
  b.memset_async(p, 1, 64, s);
  b.record_event(e, s);
  EXPECT_EQ(b.event_query(e), EventStatus::kDone);
  EXPECT_NO_THROW(b.event_synchronize(e));
  const StreamHandle t = b.create_stream();
  EXPECT_NO_THROW(b.wait_event(t, e));
  b.destroy_event(e);

  for (const auto& [api, call] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"[event_query]", [&] { (void)b.event_query(e); }},
           {"[event_synchronize]", [&] { b.event_synchronize(e); }},
           {"[record_event]", [&] { b.record_event(e, s); }},
           {"[wait_event]", [&] { b.wait_event(s, e); }},
           {"[destroy_event]", [&] { b.destroy_event(e); }},
       }) {
    const Error err = expect_error(call);
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument) << api;
    EXPECT_THAT(err.what(), HasSubstr(api));
    EXPECT_THAT(err.what(), HasSubstr(fmt::format(
                                "event 0x{:x} is not a live event of the cpu backend", e.value())));
  }
  // A live event recorded on a stream that is gone names the stream.
  const EventHandle live = b.create_event();
  b.destroy_stream(t);
  const Error gone = expect_error([&] { b.record_event(live, t); });
  EXPECT_EQ(gone.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(gone.what(), HasSubstr(fmt::format("[record_event] stream 0x{:x} is not a live "
                                                 "stream",
                                                 t.value())));
  b.destroy_event(live);
  b.destroy_stream(s);
  b.free(p);
}

TEST(CpuStreams, HandleCountsReturnToZeroAfterDestroying) {
  CpuBackend b;
  EXPECT_EQ(b.handle_counts().streams, 0u);
  const StreamHandle s1 = b.create_stream();
  const StreamHandle s2 = b.create_stream();
  EXPECT_NE(s1, s2);
  EXPECT_NE(s1, b.default_stream());
  const EventHandle e1 = b.create_event();
  const EventHandle e2 = b.create_event();
  const EventHandle e3 = b.create_event();
  b.begin_capture(s1);
  const GraphHandle g = b.end_capture(s1);
  CpuBackend::HandleCounts c = b.handle_counts();
  EXPECT_EQ(c.streams, 2u);
  EXPECT_EQ(c.events, 3u);
  EXPECT_EQ(c.graphs, 1u);
  b.destroy_graph(g);
  b.destroy_event(e1);
  b.destroy_event(e2);
  b.destroy_event(e3);
  b.destroy_stream(s1);
  b.destroy_stream(s2);
  c = b.handle_counts();
  EXPECT_EQ(c.streams, 0u);
  EXPECT_EQ(c.events, 0u);
  EXPECT_EQ(c.graphs, 0u);
}

TEST(CpuStreams, DefaultStreamCannotBeDestroyedAndDeadStreamsAreRejected) {
  CpuBackend b;
  const Error def = expect_error([&] { b.destroy_stream(b.default_stream()); });
  EXPECT_EQ(def.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(def.what(), HasSubstr("[destroy_stream] the backend's default stream"));
  // Still usable afterwards.
  const DevicePtr p = b.alloc(16);
  b.memset_async(p, 9, 16, b.default_stream());
  EXPECT_EQ(read<std::uint8_t>(b, p, 16), std::vector<std::uint8_t>(16, 9));

  const StreamHandle s = b.create_stream();
  b.destroy_stream(s);
  const Error twice = expect_error([&] { b.destroy_stream(s); });
  EXPECT_EQ(twice.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(twice.what(), HasSubstr("[destroy_stream]"));
  const Error use = expect_error([&] { b.memset_async(p, 1, 16, s); });
  EXPECT_EQ(use.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(use.what(),
              HasSubstr(fmt::format("[memset] stream 0x{:x} is not a live stream", s.value())));
  EXPECT_EQ(read<std::uint8_t>(b, p, 16), std::vector<std::uint8_t>(16, 9));
  const Error sync = expect_error([&] { b.synchronize(s); });
  EXPECT_EQ(sync.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(sync.what(), HasSubstr("[synchronize]"));
  b.free(p);
}

// Buffers for the graph tests: y += a * x over n floats, plus a byte buffer for memsets and a
// source/destination pair for copies.
struct GraphFixture {
  static constexpr std::size_t n = 2500;
  CpuBackend b;
  StreamHandle s = b.create_stream();
  DevicePtr x, y, z, src, dst;

  GraphFixture() {
    std::vector<float> xv(n), yv(n);
    for (std::size_t i = 0; i < n; ++i) {
      xv[i] = static_cast<float>(i % 13) + 1.0f;
      yv[i] = 0.5f;
    }
    x = upload(b, xv);
    y = upload(b, yv);
    z = b.alloc(64);
    b.memset(z, 0x01, 64);
    src = upload(b, std::vector<std::uint32_t>(100, 0xC0FFEEu));
    dst = upload(b, std::vector<std::uint32_t>(100, 7u));
  }
  ~GraphFixture() {
    for (DevicePtr p : {x, y, z, src, dst}) b.free(p);
    b.destroy_stream(s);
  }
  void expect_y(float times) {
    const std::vector<float> got = read<float>(b, y, n);
    for (std::size_t i = 0; i < n; ++i) {
      const float want = 0.5f + times * (static_cast<float>(i % 13) + 1.0f);
      if (got[i] != want) {
        ADD_FAILURE() << "y[" << i << "] = " << got[i] << ", expected " << want;
        return;
      }
    }
  }
};

TEST(CpuGraphs, CaptureRecordsInsteadOfRunningAndReplaysEachLaunch) {
  GraphFixture f;
  CpuBackend& b = f.b;
  // Resolve before the capture: the memoized hit is what the op uses inside it.
  const ResolvedKernel& axpy = b.op_cache().kernel(b, "core", "axpy_f32");
  b.begin_capture(f.s);
  EXPECT_TRUE(b.is_capturing(f.s));
  EXPECT_FALSE(b.is_capturing(b.default_stream()));
  b.memset_async(f.z, 0x5A, 64, f.s);
  b.copy_d2d_async(f.dst, f.src, 400, f.s);
  ops::axpy_f32(b, f.s, f.y, f.x, 1.0f, GraphFixture::n);
  EXPECT_EQ(b.op_cache().kernel(b, "core", "axpy_f32"), axpy);
  const GraphHandle g = b.end_capture(f.s);
  EXPECT_TRUE(g);
  EXPECT_FALSE(b.is_capturing(f.s));

  // Nothing ran during the capture.
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x01));
  EXPECT_EQ(read<std::uint32_t>(b, f.dst, 100), std::vector<std::uint32_t>(100, 7u));
  f.expect_y(0.0f);

  b.launch_graph(g, f.s);
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x5A));
  EXPECT_EQ(read<std::uint32_t>(b, f.dst, 100), std::vector<std::uint32_t>(100, 0xC0FFEEu));
  f.expect_y(1.0f);

  // A replay runs everything again: the axpy accumulates a second time.
  b.memset(f.z, 0x02, 64);
  b.launch_graph(g, b.default_stream());
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x5A));
  f.expect_y(2.0f);

  b.destroy_graph(g);
  EXPECT_EQ(b.handle_counts().graphs, 0u);
  const Error replay = expect_error([&] { b.launch_graph(g, f.s); });
  EXPECT_EQ(replay.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(replay.what(),
              HasSubstr(fmt::format("[launch_graph] graph 0x{:x} is not a live graph", g.value())));
  const Error destroy = expect_error([&] { b.destroy_graph(g); });
  EXPECT_EQ(destroy.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(destroy.what(), HasSubstr("[destroy_graph]"));
  f.expect_y(2.0f);
}

TEST(CpuGraphs, ACapturedLaunchKeepsTheArgumentValuesItWasCapturedWith) {
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  const ResolvedKernel fill = b.kernel("core", "fill_u32");
  constexpr std::uint32_t n = 1000;
  const DevicePtr out = upload(b, std::vector<std::uint32_t>(n, 0u));
  std::uint64_t out_address = out.address();
  std::uint32_t value = 7;
  std::uint32_t count = n;
  std::array<void*, 3> params{&out_address, &value, &count};
  const Dim3 grid{(n + b.kernel_n_tile(fill) - 1) / b.kernel_n_tile(fill)};
  b.begin_capture(s);
  b.launch(fill, grid, Dim3{256}, 0, s, params);
  value = 9;
  count = 1;
  const GraphHandle g = b.end_capture(s);
  EXPECT_EQ(read<std::uint32_t>(b, out, n), std::vector<std::uint32_t>(n, 0u));
  b.launch_graph(g, s);
  EXPECT_EQ(read<std::uint32_t>(b, out, n), std::vector<std::uint32_t>(n, 7u));
  // A direct launch with the changed values uses them (the graph kept its own copy).
  b.launch(fill, grid, Dim3{256}, 0, s, params);
  std::vector<std::uint32_t> want(n, 7u);
  want[0] = 9;
  EXPECT_EQ(read<std::uint32_t>(b, out, n), want);
  b.destroy_graph(g);
  b.destroy_stream(s);
  b.free(out);
}

TEST(CpuGraphs, SynchronizeInsideACaptureInvalidatesIt) {
  GraphFixture f;
  CpuBackend& b = f.b;
  b.begin_capture(f.s);
  b.memset_async(f.z, 0x5A, 64, f.s);
  const Error sync = expect_error([&] { b.synchronize(f.s); });
  EXPECT_EQ(sync.code(), ErrorCode::kCapture);
  EXPECT_THAT(sync.what(), HasSubstr("[synchronize]"));
  EXPECT_THAT(sync.what(), HasSubstr("invalidates it"));
  // Later work on the invalidated capture is refused, naming what spoiled it.
  const Error more = expect_error([&] { b.memset_async(f.z, 0x00, 64, f.s); });
  EXPECT_EQ(more.code(), ErrorCode::kCapture);
  EXPECT_THAT(more.what(), HasSubstr("[memset]"));
  EXPECT_THAT(more.what(), HasSubstr("was invalidated by synchronize"));
  const Error end = expect_error([&] { (void)b.end_capture(f.s); });
  EXPECT_EQ(end.code(), ErrorCode::kCapture);
  EXPECT_THAT(end.what(), HasSubstr("[end_capture]"));
  EXPECT_THAT(end.what(), HasSubstr("was invalidated by synchronize"));
  EXPECT_THAT(end.what(), HasSubstr("nothing was instantiated"));
  EXPECT_FALSE(b.is_capturing(f.s));
  EXPECT_EQ(b.handle_counts().graphs, 0u);
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x01));
  // The stream works normally again.
  b.memset_async(f.z, 0x03, 64, f.s);
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x03));
}

TEST(CpuGraphs, DeviceToHostCopyAndDeviceSyncInsideACaptureThrow) {
  GraphFixture f;
  CpuBackend& b = f.b;
  b.begin_capture(f.s);
  std::vector<std::uint32_t> host(100, 1u);
  const Error d2h = expect_error([&] { b.copy_d2h_after(host.data(), f.src, 400, f.s); });
  EXPECT_EQ(d2h.code(), ErrorCode::kCapture);
  EXPECT_THAT(d2h.what(), HasSubstr("[copy_d2h]"));
  EXPECT_EQ(host, std::vector<std::uint32_t>(100, 1u));
  const Error end = expect_error([&] { (void)b.end_capture(f.s); });
  EXPECT_EQ(end.code(), ErrorCode::kCapture);
  EXPECT_THAT(end.what(), HasSubstr("invalidated by copy_d2h"));

  b.begin_capture(f.s);
  const Error dev = expect_error([&] { b.synchronize_device(); });
  EXPECT_EQ(dev.code(), ErrorCode::kCapture);
  EXPECT_THAT(dev.what(), HasSubstr("[synchronize_device]"));
  const Error end2 = expect_error([&] { (void)b.end_capture(f.s); });
  EXPECT_EQ(end2.code(), ErrorCode::kCapture);
  EXPECT_THAT(end2.what(), HasSubstr("invalidated by synchronize_device"));

  // Blocking copies and memsets use the default stream: capturing it refuses them.
  b.begin_capture(b.default_stream());
  const Error memset = expect_error([&] { b.memset(f.z, 0, 64); });
  EXPECT_EQ(memset.code(), ErrorCode::kCapture);
  EXPECT_THAT(memset.what(), HasSubstr("[memset]"));
  const std::vector<std::uint8_t> bytes(64, 0xEE);
  const Error h2d = expect_error([&] { b.copy_h2d(f.z, bytes.data(), 64); });
  EXPECT_EQ(h2d.code(), ErrorCode::kCapture);
  b.abort_capture(b.default_stream());
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x01));
}

TEST(CpuGraphs, AbortCaptureEndsItAndIsANoOpOtherwise) {
  GraphFixture f;
  CpuBackend& b = f.b;
  b.begin_capture(f.s);
  b.memset_async(f.z, 0x5A, 64, f.s);
  b.abort_capture(f.s);
  EXPECT_FALSE(b.is_capturing(f.s));
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x01));
  const Error end = expect_error([&] { (void)b.end_capture(f.s); });
  EXPECT_EQ(end.code(), ErrorCode::kCapture);
  EXPECT_THAT(end.what(), HasSubstr("is not capturing"));
  // No-op when not capturing, and on handles that are no stream at all.
  b.abort_capture(f.s);
  b.abort_capture(StreamHandle{0xDEAD});
  EXPECT_FALSE(b.is_capturing(f.s));
  b.memset_async(f.z, 0x04, 64, f.s);
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x04));
  EXPECT_EQ(b.handle_counts().graphs, 0u);
}

TEST(CpuGraphs, BeginCaptureTwiceThrowsAndKeepsTheFirstCapture) {
  GraphFixture f;
  CpuBackend& b = f.b;
  b.begin_capture(f.s);
  b.memset_async(f.z, 0x5A, 64, f.s);
  const Error twice = expect_error([&] { b.begin_capture(f.s); });
  EXPECT_EQ(twice.code(), ErrorCode::kCapture);
  EXPECT_THAT(twice.what(), HasSubstr(fmt::format("[begin_capture] stream 0x{:x} is already "
                                                  "capturing",
                                                  f.s.value())));
  EXPECT_TRUE(b.is_capturing(f.s));
  const GraphHandle g = b.end_capture(f.s);
  b.launch_graph(g, f.s);
  EXPECT_EQ(read<std::uint8_t>(b, f.z, 64), std::vector<std::uint8_t>(64, 0x5A));
  b.destroy_graph(g);
}

TEST(CpuGraphs, KernelLookupsDuringACaptureThrowButMemoizedHitsWork) {
  GraphFixture f;
  CpuBackend& b = f.b;
  const ResolvedKernel& fill = b.op_cache().kernel(b, "core", "fill_u32");
  const std::size_t audit_before = b.lookup_audit().size();
  b.begin_capture(f.s);
  const Error direct = expect_error([&] { (void)b.kernel("core", "axpy_f32"); });
  EXPECT_EQ(direct.code(), ErrorCode::kCapture);
  EXPECT_THAT(direct.what(), HasSubstr("[kernel] cannot resolve core::axpy_f32"));
  EXPECT_THAT(direct.what(), HasSubstr("streams_test.cpp:"));
  EXPECT_THAT(direct.what(), HasSubstr("before the capture"));
  const Error miss = expect_error([&] { (void)b.op_cache().kernel(b, "core", "axpy_f32"); });
  EXPECT_EQ(miss.code(), ErrorCode::kCapture);
  EXPECT_THAT(miss.what(), HasSubstr("before the capture"));
  // An op whose kernel is not memoized fails the same way and records nothing.
  const Error op = expect_error([&] { ops::axpy_f32(b, f.s, f.y, f.x, 1.0f, GraphFixture::n); });
  EXPECT_EQ(op.code(), ErrorCode::kCapture);
  // The memoized kernel is still served, and a fill op works inside the capture.
  EXPECT_EQ(b.op_cache().kernel(b, "core", "fill_u32"), fill);
  ops::fill_u32(b, f.s, f.dst, 100, 42u);
  const GraphHandle g = b.end_capture(f.s);
  EXPECT_EQ(read<std::uint32_t>(b, f.dst, 100), std::vector<std::uint32_t>(100, 7u));
  b.launch_graph(g, f.s);
  EXPECT_EQ(read<std::uint32_t>(b, f.dst, 100), std::vector<std::uint32_t>(100, 42u));
  f.expect_y(0.0f);
  b.destroy_graph(g);
  // The failed lookups are in the audit, unresolved.
  const std::vector<KernelLookup> audit = b.lookup_audit();
  ASSERT_EQ(audit.size(), audit_before + 3);
  for (std::size_t i = audit_before; i < audit.size(); ++i) {
    EXPECT_FALSE(audit[i].resolved);
    EXPECT_EQ(audit[i].function, "axpy_f32");
    EXPECT_THAT(audit[i].error, HasSubstr("before the capture"));
  }
  // After the capture the lookup works again.
  EXPECT_TRUE(b.op_cache().kernel(b, "core", "axpy_f32"));
}

TEST(CpuGraphs, ReplayAfterACapturedBufferIsFreedFailsWithoutWriting) {
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  const DevicePtr keep = b.alloc(64);
  b.memset(keep, 0x01, 64);
  const DevicePtr doomed = b.alloc(64);
  b.begin_capture(s);
  b.memset_async(doomed, 0x5A, 64, s);
  const GraphHandle g = b.end_capture(s);
  b.free(doomed);
  const Error e = expect_error([&] { b.launch_graph(g, s); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("[memset] destination 0x{:x} is not inside any "
                                              "allocation",
                                              doomed.address())));
  EXPECT_EQ(read<std::uint8_t>(b, keep, 64), std::vector<std::uint8_t>(64, 0x01));
  b.destroy_graph(g);
  b.destroy_stream(s);
  b.free(keep);
}

TEST(CpuStreams, AsyncCopyFromPinnedMemoryHasReadItsSourceOnReturn) {
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  auto* src = static_cast<std::uint32_t*>(b.alloc_pinned(256 * 4));
  for (std::uint32_t i = 0; i < 256; ++i) src[i] = i;
  const DevicePtr dst = b.alloc(256 * 4);
  b.copy_h2d_async(dst, src, 256 * 4, s);
  for (std::uint32_t i = 0; i < 256; ++i) src[i] = 0xFFFFFFFFu;
  const std::vector<std::uint32_t> got = read<std::uint32_t>(b, dst, 256);
  for (std::uint32_t i = 0; i < 256; ++i) ASSERT_EQ(got[i], i);
  b.free(dst);
  b.free_pinned(src);
  b.destroy_stream(s);
}

TEST(CpuStreams, ThreadsLaunchingOnTheirOwnStreamsConcurrentlyGetTheirOwnResults) {
  CpuBackendOptions o;
  o.threads = 3;
  CpuBackend b(o);
  (void)b.op_cache().kernel(b, "core", "fill_u32");
  constexpr std::size_t kThreads = 4, n = 20000;
  std::vector<DevicePtr> out(kThreads);
  std::vector<StreamHandle> streams(kThreads);
  for (std::size_t t = 0; t < kThreads; ++t) {
    out[t] = b.alloc(n * 4);
    streams[t] = b.create_stream();
  }
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (std::uint32_t round = 0; round < 50; ++round) {
        ops::fill_u32(b, streams[t], out[t], n, static_cast<std::uint32_t>(t * 1000 + round));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (std::size_t t = 0; t < kThreads; ++t) {
    EXPECT_EQ(read<std::uint32_t>(b, out[t], n),
              std::vector<std::uint32_t>(n, static_cast<std::uint32_t>(t * 1000 + 49)))
        << "thread " << t;
    b.free(out[t]);
    b.destroy_stream(streams[t]);
  }
}

TEST(CpuGraphs, ACaptureOnAnotherStreamAlsoBlocksLookups) {
  CpuBackend b;
  const StreamHandle other = b.create_stream();
  b.begin_capture(other);
  const Error e = expect_error([&] { (void)b.kernel("core", "fill_u32"); });
  EXPECT_EQ(e.code(), ErrorCode::kCapture);
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("stream 0x{:x} is capturing", other.value())));
  b.abort_capture(other);
  EXPECT_TRUE(b.kernel("core", "fill_u32"));
  b.destroy_stream(other);
}

}  // namespace
}  // namespace metrale
