// The fake CUDA driver's streams, events, capture and graphs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/fake_driver.h"
#include "cuda/fake_ready.h"

namespace metrale::cuda::testing {
namespace {

using fake_test::Bytes;
using fake_test::device_2d;
using fake_test::filler;
using fake_test::kMiB;
using fake_test::Ready;

// ---- streams and events ----

TEST(FakeDriver, StreamsAreCreatedCheckedAndDestroyed) {
  Ready r;
  const DriverApi& api = r.api();
  CUstream bad = nullptr;
  EXPECT_EQ(api.cuStreamCreate(&bad, 0x4), CUDA_ERROR_INVALID_VALUE);
  const CUstream a = r.stream(), b = r.stream(CU_STREAM_DEFAULT);
  EXPECT_NE(a, b);
  EXPECT_EQ(r.fake.outstanding().streams, 2u);
  EXPECT_EQ(api.cuStreamSynchronize(a), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamSynchronize(nullptr), CUDA_SUCCESS);  // the legacy stream
  EXPECT_EQ(api.cuStreamDestroy(a), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamDestroy(a), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuStreamSynchronize(a), CUDA_ERROR_INVALID_HANDLE);
  const CUdeviceptr p = r.alloc(4);
  EXPECT_EQ(api.cuMemsetD8Async(p, 0, 4, a), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuStreamDestroy(nullptr), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuStreamDestroy(b), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(p), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().streams, 0u);
}

TEST(FakeDriver, EventsRecordQuerySynchronizeAndDestroy) {
  Ready r;
  const DriverApi& api = r.api();
  CUevent e = nullptr;
  EXPECT_EQ(api.cuEventCreate(&e, CU_EVENT_INTERPROCESS), CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(api.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().events, 1u);
  const CUstream s = r.stream();
  EXPECT_EQ(api.cuEventRecord(e, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventQuery(e), CUDA_SUCCESS);
  r.fake.set_events_ready(false);
  EXPECT_EQ(api.cuEventQuery(e), CUDA_ERROR_NOT_READY);
  EXPECT_EQ(api.cuEventSynchronize(e), CUDA_SUCCESS);
  r.fake.set_events_ready(true);
  EXPECT_EQ(api.cuEventQuery(e), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamWaitEvent(nullptr, e, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamWaitEvent(s, e, 0x8), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuEventDestroy(e), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuEventRecord(e, s), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuStreamWaitEvent(s, e, 0), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuEventDestroy(e), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().events, 0u);
}

TEST(FakeDriver, ElapsedTimeReadsTheFakeClockWithTheDriversRules) {
  Ready r;
  const DriverApi& api = r.api();
  CUevent a = nullptr, b = nullptr, untimed = nullptr;
  ASSERT_EQ(api.cuEventCreate(&a, CU_EVENT_DEFAULT), CUDA_SUCCESS);
  ASSERT_EQ(api.cuEventCreate(&b, CU_EVENT_DEFAULT), CUDA_SUCCESS);
  ASSERT_EQ(api.cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  const CUstream s = r.stream();
  float ms = -1;
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_ERROR_INVALID_HANDLE);  // not recorded
  EXPECT_EQ(api.cuEventRecord(a, s), CUDA_SUCCESS);
  r.fake.advance_clock(1.25);
  EXPECT_EQ(api.cuEventRecord(b, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventRecord(untimed, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventElapsedTime(nullptr, a, b), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_SUCCESS);
  EXPECT_FLOAT_EQ(ms, 1.25f);
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, untimed), CUDA_ERROR_INVALID_HANDLE);
  r.fake.set_events_ready(false);
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_ERROR_NOT_READY);
  r.fake.set_events_ready(true);
  // A launch moves the clock; a record inside a capture is no timestamp.
  FakeModule mod;
  mod.functions["k"] = FakeFunction{};
  CUmodule m = nullptr;
  const CUfunction f = r.function(mod, "k", &m);
  EXPECT_EQ(api.cuEventRecord(a, s), CUDA_SUCCESS);
  EXPECT_EQ(r.launch(f, s, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventRecord(b, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_SUCCESS);
  EXPECT_GT(ms, 0.0f);
  EXPECT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventRecord(b, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_ERROR_CAPTURED_EVENT);
  CUgraph g = nullptr;
  EXPECT_EQ(api.cuStreamEndCapture(s, &g), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphDestroy(g), CUDA_SUCCESS);
  // Any call can fail at its position, and does nothing else.
  r.fake.fail_at("cuEventElapsedTime", r.fake.calls("cuEventElapsedTime") + 1,
                 CUDA_ERROR_LAUNCH_FAILED);
  EXPECT_EQ(api.cuEventRecord(b, s), CUDA_SUCCESS);
  ms = -1;
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_ERROR_LAUNCH_FAILED);
  EXPECT_EQ(ms, -1.0f);
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_SUCCESS);
  for (CUevent e : {a, b, untimed}) EXPECT_EQ(api.cuEventDestroy(e), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventElapsedTime(&ms, a, b), CUDA_ERROR_INVALID_HANDLE);  // destroyed
  EXPECT_EQ(api.cuModuleUnload(m), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
}

// ---- capture and graphs ----

TEST(FakeDriver, CaptureRecordsWorkAndReplaysRunIt) {
  Ready r;
  const DriverApi& api = r.api();
  int runs = 0;
  const CUfunction k = r.function(filler(&runs), "k");
  const CUstream s = r.stream();
  CUdeviceptr p = r.alloc(32);
  r.write(p, Bytes(32, 0));
  const CUdeviceptr zero = r.alloc(8);
  r.write(zero, Bytes(8, 0));
  Bytes host{1, 2, 3, 4};
  std::uint32_t n = 8;
  void* params[] = {&p, &n};

  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_NONE);
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_ACTIVE);
  EXPECT_EQ(api.cuMemcpyDtoDAsync(p, zero, 8, s), CUDA_SUCCESS);
  EXPECT_EQ(r.launch(k, s, params), CUDA_SUCCESS);                  // fills p[0..8)
  EXPECT_EQ(api.cuMemsetD8Async(p + 8, 0x22, 4, s), CUDA_SUCCESS);  // p[8..12)
  EXPECT_EQ(api.cuMemcpyHtoDAsync(p + 12, host.data(), 4, s), CUDA_SUCCESS);
  CUgraph graph = nullptr;
  ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  ASSERT_NE(graph, nullptr);
  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_NONE);
  EXPECT_EQ(runs, 0);  // recorded, not run
  EXPECT_TRUE(r.fake.launches().empty());
  EXPECT_EQ(r.read(p, 32), Bytes(32, 0));

  CUgraphExec exec = nullptr;
  ASSERT_EQ(api.cuGraphInstantiateWithFlags(&exec, graph, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_SUCCESS);  // the exec does not need it
  EXPECT_EQ(api.cuGraphLaunch(exec, s), CUDA_SUCCESS);
  Bytes expected(32, 0);
  std::fill(expected.begin(), expected.begin() + 8, 0x7F);
  std::fill(expected.begin() + 8, expected.begin() + 12, 0x22);
  std::copy(host.begin(), host.end(), expected.begin() + 12);
  EXPECT_EQ(r.read(p, 32), expected);
  EXPECT_EQ(runs, 1);

  host = {9, 9, 9, 9};  // a replay reads the host source again, as the GPU would
  EXPECT_EQ(api.cuGraphLaunch(exec, nullptr), CUDA_SUCCESS);
  std::fill(expected.begin() + 12, expected.begin() + 16, 9);
  EXPECT_EQ(r.read(p, 32), expected);
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(r.fake.graph_replays(), 2u);
  const auto launches = r.fake.launches();
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_EQ(launches[0].function, "k");
  EXPECT_EQ(launches[0].stream, s);
  EXPECT_EQ(launches[1].stream, nullptr);  // the stream of the replay

  EXPECT_EQ(api.cuGraphExecDestroy(exec), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphExecDestroy(exec), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuGraphLaunch(exec, s), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(api.cuGraphInstantiateWithFlags(&exec, graph, 0), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(r.fake.outstanding().graphs, 0u);
  EXPECT_EQ(r.fake.outstanding().graph_execs, 0u);
}

TEST(FakeDriver, CapturedLaunchCopiesDeclaredArguments) {
  Ready r;
  const DriverApi& api = r.api();
  int runs = 0;
  const CUfunction k = r.function(filler(&runs, true), "k");
  const CUstream s = r.stream();
  const CUdeviceptr p = r.alloc(16);
  r.write(p, Bytes(16, 0));
  auto args = std::make_unique<std::pair<CUdeviceptr, std::uint32_t>>(p, 6u);
  void* params[] = {&args->first, &args->second};
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  EXPECT_EQ(r.launch(k, s, params), CUDA_SUCCESS);
  EXPECT_EQ(r.launch(k, s, nullptr), CUDA_ERROR_INVALID_VALUE);  // declared, none given
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  ASSERT_EQ(api.cuGraphInstantiateWithFlags(&exec, graph, 0), CUDA_SUCCESS);
  args.reset();  // the caller's arguments are gone (ASan would see a read)
  EXPECT_EQ(api.cuGraphLaunch(exec, s), CUDA_SUCCESS);
  Bytes expected(16, 0);
  std::fill(expected.begin(), expected.begin() + 6, 0x7F);
  EXPECT_EQ(r.read(p, 16), expected);
  EXPECT_EQ(runs, 1);
}

TEST(FakeDriver, SynchronizingACapturingStreamInvalidatesTheCapture) {
  Ready r;
  const DriverApi& api = r.api();
  const CUstream s = r.stream();
  const CUdeviceptr p = r.alloc(4);
  r.write(p, Bytes(4, 0));
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemsetD8Async(p, 1, 4, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  EXPECT_EQ(api.cuMemsetD8Async(p, 1, 4, s), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  EXPECT_EQ(api.cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CUgraph graph = reinterpret_cast<CUgraph>(std::uintptr_t{0x99});
  EXPECT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  EXPECT_EQ(graph, nullptr);
  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_NONE);  // the capture ended
  EXPECT_EQ(r.fake.outstanding().graphs, 0u);
  EXPECT_EQ(r.read(p, 4), Bytes(4, 0));
  EXPECT_EQ(api.cuMemsetD8Async(p, 3, 4, s), CUDA_SUCCESS);  // the stream works again
  EXPECT_EQ(r.read(p, 4), Bytes(4, 3));
}

TEST(FakeDriver, DeviceToHostCopyInACaptureInvalidatesIt) {
  Ready r;
  const DriverApi& api = r.api();
  const CUstream s = r.stream();
  const CUdeviceptr p = r.alloc(8);
  r.write(p, Bytes(8, 5));
  Bytes out(8, 0);
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemcpyDtoHAsync(out.data(), p, 8, s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(out, Bytes(8, 0));
  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  CUgraph graph = nullptr;
  EXPECT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

  // The 2D form into host memory too.
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  CUDA_MEMCPY2D c = device_2d(0, 8, p, 8, 8, 1);
  c.dstMemoryType = CU_MEMORYTYPE_HOST;
  c.dstHost = out.data();
  EXPECT_EQ(api.cuMemcpy2DAsync(&c, s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  EXPECT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  EXPECT_EQ(out, Bytes(8, 0));
}

TEST(FakeDriver, CtxSynchronizeDuringAnyCaptureInvalidatesIt) {
  Ready r;
  const DriverApi& api = r.api();
  const CUstream a = r.stream(), b = r.stream();
  EXPECT_EQ(api.cuCtxSynchronize(), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamBeginCapture(a, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamBeginCapture(b, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  EXPECT_EQ(api.cuCtxSynchronize(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(r.capture_status(a), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  EXPECT_EQ(r.capture_status(b), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  CUgraph graph = nullptr;
  EXPECT_EQ(api.cuStreamEndCapture(a, &graph), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  EXPECT_EQ(api.cuStreamEndCapture(b, &graph), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  EXPECT_EQ(api.cuCtxSynchronize(), CUDA_SUCCESS);
}

// cuThreadExchangeStreamCaptureMode's documentation: cudaMalloc (here cuMemAlloc) is refused to
// a thread in GLOBAL or THREAD_LOCAL mode that has a capture of its own not begun RELAXED, and to
// one in GLOBAL mode while another thread captures in GLOBAL; a RELAXED thread may always call
// it. A refused call invalidates the capture it conflicts with.
TEST(FakeDriver, AllocationsDuringACaptureFollowTheThreadsCaptureMode) {
  Ready r;
  const DriverApi& api = r.api();
  const CUstream s = r.stream();
  CUdeviceptr p = 0;
  CUgraph graph = nullptr;
  const auto exchange = [&](CUstreamCaptureMode mode) {
    EXPECT_EQ(api.cuThreadExchangeStreamCaptureMode(&mode), CUDA_SUCCESS);
    return mode;
  };
  const auto end = [&](CUresult expected) {
    EXPECT_EQ(api.cuStreamEndCapture(s, &graph), expected);
    if (graph != nullptr) {
      EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_SUCCESS);
    }
  };

  // Its own capture, begun GLOBAL: refused, then allowed once the thread is RELAXED.
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemAlloc(&p, 64), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(r.capture_status(s), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  end(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), CUDA_SUCCESS);
  EXPECT_EQ(exchange(CU_STREAM_CAPTURE_MODE_RELAXED), CU_STREAM_CAPTURE_MODE_GLOBAL);
  ASSERT_EQ(api.cuMemAlloc(&p, 64), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(p), CUDA_SUCCESS);
  EXPECT_EQ(exchange(CU_STREAM_CAPTURE_MODE_GLOBAL), CU_STREAM_CAPTURE_MODE_RELAXED);
  end(CUDA_SUCCESS);
  // Its own capture, begun RELAXED: allowed.
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  ASSERT_EQ(api.cuMemAlloc(&p, 64), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(p), CUDA_SUCCESS);
  end(CUDA_SUCCESS);

  // Another thread's capture: a GLOBAL one refuses this thread in GLOBAL mode only.
  for (const CUstreamCaptureMode theirs :
       {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL}) {
    for (const CUstreamCaptureMode mine :
         {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL}) {
      std::thread([&] {
        EXPECT_EQ(api.cuCtxSetCurrent(r.ctx), CUDA_SUCCESS);
        EXPECT_EQ(api.cuStreamBeginCapture(s, theirs), CUDA_SUCCESS);
      }).join();
      exchange(mine);
      const bool refused =
          theirs == CU_STREAM_CAPTURE_MODE_GLOBAL && mine == CU_STREAM_CAPTURE_MODE_GLOBAL;
      const CUresult got = api.cuMemAlloc(&p, 64);
      EXPECT_EQ(got, refused ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS)
          << "their mode " << theirs << ", mine " << mine;
      if (got == CUDA_SUCCESS) {
        EXPECT_EQ(api.cuMemFree(p), CUDA_SUCCESS);
      }
      exchange(CU_STREAM_CAPTURE_MODE_GLOBAL);
      end(refused ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS);
    }
  }
}

TEST(FakeDriver, LegacyStreamWorkBreaksOnlyBlockingCaptures) {
  Ready r;
  const DriverApi& api = r.api();
  const CUstream blocking = r.stream(CU_STREAM_DEFAULT), non_blocking = r.stream();
  const CUdeviceptr p = r.alloc(4);
  ASSERT_EQ(api.cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamBeginCapture(non_blocking, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  // Asking about the legacy stream reports the conflict and leaves the capture alone.
  EXPECT_EQ(api.cuStreamIsCapturing(nullptr, &status), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  EXPECT_EQ(r.capture_status(blocking), CU_STREAM_CAPTURE_STATUS_ACTIVE);
  EXPECT_EQ(api.cuMemsetD8Async(p, 0, 4, nullptr), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  EXPECT_EQ(r.capture_status(blocking), CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  EXPECT_EQ(r.capture_status(non_blocking), CU_STREAM_CAPTURE_STATUS_ACTIVE);
  EXPECT_EQ(api.cuMemsetD8Async(p, 0, 4, nullptr), CUDA_SUCCESS);  // no active blocking one
  EXPECT_EQ(api.cuStreamIsCapturing(nullptr, &status), CUDA_SUCCESS);
  EXPECT_EQ(status, CU_STREAM_CAPTURE_STATUS_NONE);
}

TEST(FakeDriver, CaptureStateErrors) {
  Ready r;
  const DriverApi& api = r.api();
  const CUstream s = r.stream();
  CUgraph graph = nullptr;
  EXPECT_EQ(api.cuStreamBeginCapture(nullptr, CU_STREAM_CAPTURE_MODE_RELAXED),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  EXPECT_EQ(api.cuStreamBeginCapture(s, static_cast<CUstreamCaptureMode>(3)),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_ERROR_ILLEGAL_STATE);
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_ERROR_ILLEGAL_STATE);
  CUevent e = nullptr;
  ASSERT_EQ(api.cuEventCreate(&e, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventRecord(e, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventQuery(e), CUDA_ERROR_CAPTURED_EVENT);
  EXPECT_EQ(api.cuEventSynchronize(e), CUDA_ERROR_CAPTURED_EVENT);
  ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventRecord(e, s), CUDA_SUCCESS);  // recorded outside capture again
  EXPECT_EQ(api.cuEventQuery(e), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_SUCCESS);
}

TEST(FakeDriver, ReplayTouchingFreedMemoryIsAStickyIllegalAddress) {
  Ready r;
  const DriverApi& api = r.api();
  const CUstream s = r.stream();
  const CUdeviceptr p = r.alloc(4);
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemsetD8Async(p + 8, 0, 4, s), CUDA_ERROR_INVALID_VALUE);  // checked now too
  EXPECT_EQ(api.cuMemsetD8Async(p, 0, 4, s), CUDA_SUCCESS);
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  ASSERT_EQ(api.cuGraphInstantiateWithFlags(&exec, graph, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphLaunch(exec, s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(p), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphLaunch(exec, s), CUDA_ERROR_ILLEGAL_ADDRESS);
  EXPECT_EQ(api.cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
  EXPECT_EQ(api.cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
}

}  // namespace
}  // namespace metrale::cuda::testing
