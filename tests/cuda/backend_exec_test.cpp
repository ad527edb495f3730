// Execution on the CUDA backend over the fake driver: copies, memsets, launches (dynamic shared
// memory, debug sync), streams, events, graphs and captures, memory queries, and the sticky
// device fault.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/log_capture.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using metrale::testing::LogCapture;
using ::testing::HasSubstr;

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

// ---- copies and memsets ----

TEST(CudaExec, BlockingCopiesMoveBytes) {
  Rig rig;
  CudaBackend& b = rig.b();
  const auto data = random_bytes(1000, std::random_device{}());
  const DevicePtr a = b.alloc(1000);
  const DevicePtr c = b.alloc(1000);
  b.copy_h2d(a, data.data(), data.size());
  b.copy_d2d(c, a, data.size());
  std::vector<std::uint8_t> out(1000, 0);
  b.copy_d2h(out.data(), c, out.size());
  EXPECT_EQ(out, data);
  // A part of a buffer, at an offset.
  std::vector<std::uint8_t> part(100, 0);
  b.copy_d2h(part.data(), c.offset(900), 100);
  EXPECT_TRUE(std::equal(part.begin(), part.end(), data.begin() + 900));
  // Zero bytes is a no-op, even with null pointers.
  const auto copies = rig.fd.calls("cuMemcpyHtoDAsync");
  EXPECT_NO_THROW(b.copy_h2d(DevicePtr{}, nullptr, 0));
  EXPECT_EQ(rig.fd.calls("cuMemcpyHtoDAsync"), copies);
  b.free(a);
  b.free(c);
}

TEST(CudaExec, CopiesRefuseNullPointersAndReportDriverFailures) {
  Rig rig;
  CudaBackend& b = rig.b();
  const DevicePtr a = b.alloc(64);
  std::uint8_t host[64] = {};
  EXPECT_EQ(expect_error([&] { b.copy_h2d(DevicePtr{}, host, 64); }).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { b.copy_d2h(nullptr, a, 64); }).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { b.copy_d2d(a, DevicePtr{}, 64); }).code(),
            ErrorCode::kInvalidArgument);
  // Past the end of the allocation: the driver refuses it.
  const Error e = expect_error([&] { b.copy_h2d(a, host, 64 + 1); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[copy_h2d] cuMemcpyHtoDAsync failed: CUDA_ERROR_INVALID_VALUE"));
  b.free(a);
}

TEST(CudaExec, AsyncCopiesOnACreatedStreamAndCopyD2hAfter) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  const auto data = random_bytes(512, 7);
  const DevicePtr a = b.alloc(512);
  const DevicePtr c = b.alloc(512);
  b.copy_h2d_async(a, data.data(), 512, s);
  b.copy_d2d_async(c, a, 512, s);
  std::vector<std::uint8_t> out(512, 0);
  const auto syncs = rig.fd.calls("cuStreamSynchronize");
  b.copy_d2h_after(out.data(), c, 512, s);
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs + 1);  // it waits for the stream
  EXPECT_EQ(out, data);
  b.free(a);
  b.free(c);
  b.destroy_stream(s);
}

TEST(CudaExec, Copy2dHonoursBothPitches) {
  Rig rig;
  CudaBackend& b = rig.b();
  constexpr std::size_t kSrcPitch = 64, kDstPitch = 48, kWidth = 40, kRows = 5;
  const auto data = random_bytes(kSrcPitch * kRows, 11);
  const DevicePtr src = b.alloc(kSrcPitch * kRows);
  const DevicePtr dst = b.alloc(kDstPitch * kRows);
  b.copy_h2d(src, data.data(), data.size());
  b.memset(dst, 0x5A, kDstPitch * kRows);
  b.copy_2d_async(dst, kDstPitch, src, kSrcPitch, kWidth, kRows, b.default_stream());
  b.synchronize(b.default_stream());
  std::vector<std::uint8_t> out(kDstPitch * kRows);
  b.copy_d2h(out.data(), dst, out.size());
  for (std::size_t r = 0; r < kRows; ++r) {
    for (std::size_t x = 0; x < kDstPitch; ++x) {
      const std::uint8_t want = x < kWidth ? data[r * kSrcPitch + x] : 0x5A;
      ASSERT_EQ(out[r * kDstPitch + x], want) << "row " << r << " byte " << x;
    }
  }
  const Error e = expect_error(
      [&] { b.copy_2d_async(dst, kDstPitch, src, kSrcPitch, 50, kRows, b.default_stream()); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[copy_2d] width 50 bytes exceeds a pitch (dst 48, src 64)"));
  b.free(src);
  b.free(dst);
}

TEST(CudaExec, MemsetAndMemsetAsync) {
  Rig rig;
  CudaBackend& b = rig.b();
  const DevicePtr a = b.alloc(300);
  b.memset(a, 0x3C, 300);
  for (std::size_t i = 0; i < 300; ++i) ASSERT_EQ(host_view<std::uint8_t>(a)[i], 0x3C) << i;
  const StreamHandle s = b.create_stream();
  b.memset_async(a.offset(100), 0x00, 50, s);
  b.synchronize(s);
  for (std::size_t i = 0; i < 300; ++i) {
    ASSERT_EQ(host_view<std::uint8_t>(a)[i], (i >= 100 && i < 150) ? 0x00 : 0x3C) << i;
  }
  EXPECT_EQ(expect_error([&] { b.memset(DevicePtr{}, 0, 4); }).code(), ErrorCode::kInvalidArgument);
  b.free(a);
  b.destroy_stream(s);
}

// ---- launches ----

TEST(CudaExec, LaunchPassesGridBlockSharedAndStream) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& nop = b.op_cache().kernel(b, "core", "nop");
  const StreamHandle s = b.create_stream();
  b.launch(nop, Dim3{3, 2, 1}, Dim3{64, 2, 1}, 1024, s, {});
  const auto launches = rig.fd.launches();
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].function, "nop");
  EXPECT_EQ(launches[0].grid[0], 3u);
  EXPECT_EQ(launches[0].grid[1], 2u);
  EXPECT_EQ(launches[0].block[0], 64u);
  EXPECT_EQ(launches[0].block[1], 2u);
  EXPECT_EQ(launches[0].shared_bytes, 1024u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(launches[0].stream), s.value());
  // The null handle is the backend's default stream (the host's).
  b.launch(nop, Dim3{}, Dim3{32}, 0, StreamHandle{}, {});
  EXPECT_EQ(rig.fd.launches().back().stream, rig.host->stream());
  b.destroy_stream(s);
}

TEST(CudaExec, LaunchRefusesAHandleThisBackendDidNotResolve) {
  Rig rig;
  const Error e = expect_error(
      [&] { rig.b().launch(KernelHandle{0x1234}, Dim3{}, Dim3{}, 0, StreamHandle{}, {}); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("kernel 0x1234 was not resolved by this cuda backend"));
  EXPECT_TRUE(rig.fd.launches().empty());
}

TEST(CudaExec, AFailedLaunchNamesTheKernelGridBlockAndSharedMemory) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& nop = b.op_cache().kernel(b, "core", "nop");
  // A block of 2048 threads: the driver refuses it.
  const Error e = expect_error([&] { b.launch(nop, Dim3{4}, Dim3{2048}, 0, StreamHandle{}, {}); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[launch] cuLaunchKernel core::nop grid (4, 1, 1) block "
                                  "(2048, 1, 1) shared 0 B failed: CUDA_ERROR_INVALID_VALUE (1)"));
  EXPECT_FALSE(rig.host->faulted());  // probed, not a sticky fault
  EXPECT_NO_THROW(b.launch(nop, Dim3{4}, Dim3{256}, 0, StreamHandle{}, {}));
}

TEST(CudaExec, SharedMemoryAbove48KiBRaisesTheLimitOncePerSize) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& nop = b.op_cache().kernel(b, "core", "nop");
  const auto launch = [&](std::uint32_t shared) {
    b.launch(nop, Dim3{1}, Dim3{128}, shared, StreamHandle{}, {});
  };
  launch(48 * 1024);  // the default limit: no opt-in
  EXPECT_EQ(rig.fd.calls("cuFuncSetAttribute"), 0u);
  launch(64 * 1024);
  EXPECT_EQ(rig.fd.calls("cuFuncSetAttribute"), 1u);
  EXPECT_EQ(rig.fd.max_dynamic_shared("nop"), 64 * 1024);
  launch(64 * 1024);  // same size: already raised
  launch(56 * 1024);  // smaller: the raised limit covers it
  EXPECT_EQ(rig.fd.calls("cuFuncSetAttribute"), 1u);
  launch(100 * 1024);  // larger: raised again
  EXPECT_EQ(rig.fd.calls("cuFuncSetAttribute"), 2u);
  EXPECT_EQ(rig.fd.max_dynamic_shared("nop"), 100 * 1024);
  EXPECT_EQ(rig.fd.launches().size(), 5u);
}

TEST(CudaExec, SharedMemoryBeyondTheDeviceOptInMaximumIsRefused) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& nop = b.op_cache().kernel(b, "core", "nop");
  EXPECT_NO_THROW(b.launch(nop, Dim3{1}, Dim3{32}, 232448, StreamHandle{}, {}));  // the maximum
  for (std::uint32_t shared : {232448u + 1u, 0x7FFFFFFFu, 0x80000000u, 0xFFFFFFFFu}) {
    SCOPED_TRACE(shared);
    const auto sets = rig.fd.calls("cuFuncSetAttribute");
    const auto launches = rig.fd.calls("cuLaunchKernel");
    const Error e =
        expect_error([&] { b.launch(nop, Dim3{1}, Dim3{32}, shared, StreamHandle{}, {}); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("[launch] core::nop grid (1, 1, 1) block (32, 1, 1) shared " +
                                    std::to_string(shared) + " B"));
    EXPECT_THAT(e.what(), HasSubstr("the device allows at most 232448 B of shared memory"));
    EXPECT_EQ(rig.fd.calls("cuFuncSetAttribute"), sets);
    EXPECT_EQ(rig.fd.calls("cuLaunchKernel"), launches);
  }
}

// A module whose "crash" kernel faults the device the way an illegal address does: the launch
// itself succeeds, the fault shows at the next synchronization.
ModuleSpec crashing_module(FakeDriver*& fd) {
  ModuleSpec m = core_module();
  m.fake.functions["crash"].body = [&fd](const FakeLaunch&) {
    fd->set_sticky_fault(CUDA_ERROR_ILLEGAL_ADDRESS);
  };
  return m;
}

TEST(CudaExec, DebugSyncWaitsAfterEveryLaunch) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& nop = b.op_cache().kernel(b, "core", "nop");
  auto syncs = rig.fd.calls("cuStreamSynchronize");
  b.launch(nop, Dim3{}, Dim3{32}, 0, StreamHandle{}, {});
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs);
  b.set_debug_sync(true);
  EXPECT_TRUE(b.debug_sync());
  b.launch(nop, Dim3{}, Dim3{32}, 0, StreamHandle{}, {});
  b.launch(nop, Dim3{}, Dim3{32}, 0, StreamHandle{}, {});
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs + 2);
  // Inside a capture it does not wait (that would break the capture).
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  syncs = rig.fd.calls("cuStreamSynchronize");
  b.launch(nop, Dim3{}, Dim3{32}, 0, s, {});
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs);
  b.destroy_graph(b.end_capture(s));
  b.destroy_stream(s);
}

TEST(CudaExec, DebugSyncReportsAFaultAtTheKernelThatCausedIt) {
  FakeDriver* fd = nullptr;
  Rig rig({.modules = {crashing_module(fd)}});
  fd = &rig.fd;
  CudaBackend& b = rig.b();
  const ResolvedKernel& crash = b.op_cache().kernel(b, "core", "crash");
  b.set_debug_sync(true);
  LogCapture logs;
  const Error e =
      expect_error([&] { b.launch(crash, Dim3{2}, Dim3{32}, 4096, StreamHandle{}, {}); });
  EXPECT_EQ(e.code(), ErrorCode::kDeviceFault);
  EXPECT_THAT(e.what(), HasSubstr("[launch] core::crash grid (2, 1, 1) block (32, 1, 1) shared "
                                  "4096 B (debug sync after the launch) failed: "
                                  "CUDA_ERROR_ILLEGAL_ADDRESS (700)"));
  EXPECT_TRUE(rig.host->faulted());
  EXPECT_EQ(logs.count(log::Level::kError, "is faulted"), 1u);
}

TEST(CudaExec, WithoutDebugSyncTheFaultShowsAtTheNextSynchronize) {
  FakeDriver* fd = nullptr;
  Rig rig({.modules = {crashing_module(fd)}});
  fd = &rig.fd;
  CudaBackend& b = rig.b();
  const ResolvedKernel& crash = b.op_cache().kernel(b, "core", "crash");
  EXPECT_NO_THROW(b.launch(crash, Dim3{2}, Dim3{32}, 0, StreamHandle{}, {}));
  const Error e = expect_error([&] { b.synchronize(StreamHandle{}); });
  EXPECT_EQ(e.code(), ErrorCode::kDeviceFault);
  EXPECT_THAT(e.what(), HasSubstr("[synchronize] cuStreamSynchronize failed: "
                                  "CUDA_ERROR_ILLEGAL_ADDRESS"));
  EXPECT_TRUE(rig.host->faulted());
}

// ---- streams and events ----

TEST(CudaExec, StreamsAreCreatedAndDestroyedAndTheDefaultOneIsNot) {
  Rig rig;
  CudaBackend& b = rig.b();
  EXPECT_EQ(rig.fd.outstanding().streams, 1u);  // the host's
  EXPECT_EQ(b.default_stream().value(), reinterpret_cast<std::uintptr_t>(rig.host->stream()));
  const StreamHandle s = b.create_stream();
  ASSERT_TRUE(s);
  EXPECT_NE(s, b.default_stream());
  EXPECT_EQ(rig.fd.outstanding().streams, 2u);
  b.synchronize(s);
  b.synchronize_device();
  b.destroy_stream(s);
  EXPECT_EQ(rig.fd.outstanding().streams, 1u);
  const Error again = expect_error([&] { b.destroy_stream(s); });
  EXPECT_EQ(again.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(again.what(), HasSubstr("is not a live stream of this cuda backend"));
  const Error dflt = expect_error([&] { b.destroy_stream(b.default_stream()); });
  EXPECT_EQ(dflt.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(dflt.what(), HasSubstr("[destroy_stream] the backend's default stream belongs to "
                                     "the process host"));
  EXPECT_EQ(expect_error([&] { b.destroy_stream(StreamHandle{}); }).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(rig.fd.outstanding().streams, 1u);
  EXPECT_EQ(expect_error([&] { b.synchronize(s); }).code(), ErrorCode::kInvalidArgument);
}

// The table the host is built on, with shims that record what the backend asks for.
CUstreamCaptureMode g_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
unsigned g_stream_flags = 0;
PFN_cuStreamBeginCapture_v10010 g_real_begin = nullptr;
PFN_cuStreamCreate_v2000 g_real_create = nullptr;
CUresult recording_begin_capture(CUstream s, CUstreamCaptureMode mode) {
  g_capture_mode = mode;
  return g_real_begin(s, mode);
}
CUresult recording_stream_create(CUstream* s, unsigned int flags) {
  g_stream_flags = flags;
  return g_real_create(s, flags);
}
void record_calls(DriverApi& api) {
  g_real_begin = api.cuStreamBeginCapture;
  g_real_create = api.cuStreamCreate;
  api.cuStreamBeginCapture = &recording_begin_capture;
  api.cuStreamCreate = &recording_stream_create;
}

TEST(CudaExec, StreamsAreNonBlockingAndCapturesAreRelaxed) {
  Rig rig({.tweak_api = record_calls});
  CudaBackend& b = rig.b();
  g_stream_flags = 0;
  const StreamHandle s = b.create_stream();
  EXPECT_EQ(g_stream_flags, unsigned{CU_STREAM_NON_BLOCKING});
  g_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  b.begin_capture(s);
  EXPECT_EQ(g_capture_mode, CU_STREAM_CAPTURE_MODE_RELAXED);
  b.abort_capture(s);
  b.destroy_stream(s);
}

TEST(CudaExec, EventsAreDoneNotReadyOrAnError) {
  Rig rig;
  CudaBackend& b = rig.b();
  const EventHandle e = b.create_event();
  ASSERT_TRUE(e);
  EXPECT_EQ(rig.fd.outstanding().events, 1u);
  const StreamHandle s = b.create_stream();
  b.record_event(e, s);
  b.wait_event(b.default_stream(), e);
  b.event_synchronize(e);
  EXPECT_EQ(b.event_query(e), EventStatus::kDone);
  rig.fd.set_events_ready(false);
  EXPECT_EQ(b.event_query(e), EventStatus::kNotReady);
  rig.fd.set_events_ready(true);
  rig.fd.fail_at("cuEventQuery", rig.fd.calls("cuEventQuery") + 1, CUDA_ERROR_INVALID_HANDLE);
  const Error err = expect_error([&] { b.event_query(e); });
  EXPECT_EQ(err.code(), ErrorCode::kDriver);
  EXPECT_THAT(err.what(),
              HasSubstr("[event_query] cuEventQuery failed: CUDA_ERROR_INVALID_HANDLE (400)"));
  b.destroy_event(e);
  EXPECT_EQ(rig.fd.outstanding().events, 0u);
  const Error gone = expect_error([&] { b.event_query(e); });
  EXPECT_EQ(gone.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(gone.what(), HasSubstr("is not a live event of this cuda backend"));
  EXPECT_EQ(expect_error([&] { b.destroy_event(e); }).code(), ErrorCode::kInvalidArgument);
  b.destroy_stream(s);
}

TEST(CudaExec, AnEventRecordedInACaptureCannotBeQueried) {
  Rig rig;
  CudaBackend& b = rig.b();
  const EventHandle e = b.create_event();
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  b.record_event(e, s);
  const Error err = expect_error([&] { b.event_query(e); });
  EXPECT_EQ(err.code(), ErrorCode::kCapture);
  EXPECT_THAT(err.what(), HasSubstr("CUDA_ERROR_CAPTURED_EVENT"));
  b.abort_capture(s);
  b.destroy_event(e);
  b.destroy_stream(s);
}

// ---- graphs ----

TEST(CudaExec, ACaptureBecomesAGraphThatReplays) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& fill = b.op_cache().kernel(b, "core", "fill_u32");  // before the capture
  const DevicePtr out = b.alloc(1000 * 4);
  const DevicePtr flag = b.alloc(16);
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  EXPECT_TRUE(b.is_capturing(s));
  EXPECT_FALSE(b.is_capturing(b.default_stream()));
  b.memset_async(flag, 0x77, 16, s);
  ops::fill_u32(b, s, out, 1000, 0xC0FFEEu);
  EXPECT_TRUE(rig.fd.launches().empty());             // recorded, not run
  EXPECT_EQ(host_view<std::uint8_t>(flag)[0], 0xA5);  // the fake's fresh-memory byte
  const GraphHandle g = b.end_capture(s);
  ASSERT_TRUE(g);
  EXPECT_FALSE(b.is_capturing(s));
  // The template is always destroyed; only the instantiated graph is kept.
  EXPECT_EQ(rig.fd.calls("cuGraphInstantiateWithFlags"), 1u);
  EXPECT_EQ(rig.fd.calls("cuGraphDestroy"), 1u);
  EXPECT_EQ(rig.fd.outstanding().graphs, 0u);
  EXPECT_EQ(rig.fd.outstanding().graph_execs, 1u);

  for (int replay = 1; replay <= 2; ++replay) {
    b.memset(out, 0x00, 1000 * 4);
    b.memset(flag, 0x00, 16);
    b.launch_graph(g, s);
    b.synchronize(s);
    EXPECT_EQ(rig.fd.graph_replays(), static_cast<std::uint64_t>(replay));
    for (std::size_t i = 0; i < 1000; ++i) ASSERT_EQ(host_view<std::uint32_t>(out)[i], 0xC0FFEEu);
    EXPECT_EQ(host_view<std::uint8_t>(flag)[15], 0x77);
  }
  EXPECT_EQ(rig.fd.launches().size(), 2u);
  EXPECT_EQ(rig.fd.launches()[0].function, "fill_u32");
  (void)fill;
  b.destroy_graph(g);
  EXPECT_EQ(rig.fd.outstanding().graph_execs, 0u);
  const Error gone = expect_error([&] { b.launch_graph(g, s); });
  EXPECT_EQ(gone.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(gone.what(), HasSubstr("is not a live graph of this cuda backend"));
  EXPECT_EQ(expect_error([&] { b.destroy_graph(g); }).code(), ErrorCode::kInvalidArgument);
  b.free(out);
  b.free(flag);
  b.destroy_stream(s);
}

TEST(CudaExec, ASynchronizeInsideACaptureInvalidatesIt) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  const DevicePtr a = b.alloc(64);
  b.begin_capture(s);
  b.memset_async(a, 1, 64, s);
  const Error sync = expect_error([&] { b.synchronize(s); });
  EXPECT_EQ(sync.code(), ErrorCode::kCapture);
  const Error end = expect_error([&] { b.end_capture(s); });
  EXPECT_EQ(end.code(), ErrorCode::kCapture);
  EXPECT_THAT(end.what(), HasSubstr("[end_capture] cuStreamEndCapture failed: "
                                    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"));
  EXPECT_FALSE(b.is_capturing(s));
  EXPECT_EQ(rig.fd.outstanding().graphs, 0u);
  EXPECT_EQ(rig.fd.outstanding().graph_execs, 0u);
  b.free(a);
  b.destroy_stream(s);
}

TEST(CudaExec, ADeviceToHostCopyInsideACaptureIsACaptureError) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  const DevicePtr a = b.alloc(64);
  std::uint8_t host[64];
  b.begin_capture(s);
  const Error e = expect_error([&] { b.copy_d2h_after(host, a, 64, s); });
  EXPECT_EQ(e.code(), ErrorCode::kCapture);
  EXPECT_THAT(e.what(), HasSubstr("[copy_d2h] cuMemcpyDtoHAsync failed: "
                                  "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"));
  EXPECT_EQ(expect_error([&] { b.end_capture(s); }).code(), ErrorCode::kCapture);
  b.free(a);
  b.destroy_stream(s);
}

TEST(CudaExec, AFailedInstantiationStillDestroysTheTemplate) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  rig.fd.fail_at("cuGraphInstantiateWithFlags", 1, CUDA_ERROR_OUT_OF_MEMORY);
  const Error e = expect_error([&] { b.end_capture(s); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("[end_capture] cuGraphInstantiateWithFlags failed"));
  EXPECT_EQ(rig.fd.outstanding().graphs, 0u);
  EXPECT_EQ(rig.fd.outstanding().graph_execs, 0u);
  b.destroy_stream(s);
}

TEST(CudaExec, AbortCaptureEndsAnActiveCaptureAndIsANoOpOtherwise) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  b.abort_capture(s);  // nothing to end
  EXPECT_EQ(rig.fd.calls("cuStreamEndCapture"), 0u);
  b.begin_capture(s);
  b.memset_async(b.alloc(16), 0, 16, s);
  b.abort_capture(s);
  EXPECT_EQ(rig.fd.calls("cuStreamEndCapture"), 1u);
  EXPECT_FALSE(b.is_capturing(s));
  EXPECT_EQ(rig.fd.outstanding().graphs, 0u);
  EXPECT_EQ(rig.fd.outstanding().graph_execs, 0u);
  b.abort_capture(s);
  EXPECT_EQ(rig.fd.calls("cuStreamEndCapture"), 1u);
  // A stream that is not the backend's: logged, never thrown.
  LogCapture logs;
  EXPECT_NO_THROW(b.abort_capture(StreamHandle{0xBAD0}));
  EXPECT_EQ(logs.count(log::Level::kWarn, "abort_capture"), 1u);
  // The stream captures again normally.
  b.begin_capture(s);
  b.destroy_graph(b.end_capture(s));
  b.destroy_stream(s);
}

TEST(CudaExec, AFailedCaptureQueryCountsAsCapturing) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  EXPECT_FALSE(b.is_capturing(s));
  rig.fd.fail_at("cuStreamIsCapturing", rig.fd.calls("cuStreamIsCapturing") + 1,
                 CUDA_ERROR_UNKNOWN);
  EXPECT_TRUE(b.is_capturing(s));
  EXPECT_FALSE(b.is_capturing(s));
  // A kernel lookup, which must know, refuses rather than risk a capture, naming the failed
  // query rather than blaming a capture that may not exist.
  rig.fd.fail_at("cuStreamIsCapturing", rig.fd.calls("cuStreamIsCapturing") + 1,
                 CUDA_ERROR_UNKNOWN);
  const Error lookup = expect_error([&] { b.kernel("core", "fill_u32"); });
  EXPECT_EQ(lookup.code(), ErrorCode::kDriver);
  EXPECT_THAT(lookup.what(), HasSubstr("[kernel] cuStreamIsCapturing failed: CUDA_ERROR_UNKNOWN"));
  EXPECT_EQ(expect_error([&] { b.is_capturing(StreamHandle{0xBAD0}); }).code(),
            ErrorCode::kInvalidArgument);
  b.destroy_stream(s);
}

// A copy from pinned memory must know whether to wait before the caller reuses the source, so a
// failed query is an error naming it, asked before anything is queued (see Note [pinned copy waits]
// in docs/NOTES.md).
TEST(CudaExec, APinnedCopyWhoseCaptureQueryFailsQueuesNothing) {
  Rig rig;
  CudaBackend& b = rig.b();
  const DevicePtr d = b.alloc(64);
  void* src = b.alloc_pinned(64);
  const auto copies = rig.fd.calls("cuMemcpyHtoDAsync");
  rig.fd.fail_at("cuStreamIsCapturing", rig.fd.calls("cuStreamIsCapturing") + 1,
                 CUDA_ERROR_UNKNOWN);
  const Error e = expect_error([&] { b.copy_h2d_async(d, src, 64, b.default_stream()); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[copy_h2d] cuStreamIsCapturing failed"));
  EXPECT_EQ(rig.fd.calls("cuMemcpyHtoDAsync"), copies);
  // Asked successfully, the copy is queued and waited for.
  const auto syncs = rig.fd.calls("cuStreamSynchronize");
  b.copy_h2d_async(d, src, 64, b.default_stream());
  EXPECT_EQ(rig.fd.calls("cuMemcpyHtoDAsync"), copies + 1);
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs + 1);
  b.free_pinned(src);
  b.free(d);
}

// ---- memory queries ----

TEST(CudaExec, MemoryQueriesOnADiscreteDevice) {
  FakeDevice dev;
  dev.sm_count = 78;
  dev.total_memory = std::size_t{64} << 20;
  Rig rig({.devices = {dev}});
  CudaBackend& b = rig.b();
  EXPECT_EQ(b.sm_count(), 78u);
  EXPECT_EQ(b.total_memory(), std::size_t{64} << 20);
  EXPECT_EQ(b.driver_free_memory(), std::size_t{64} << 20);
  const DevicePtr p = b.alloc(std::size_t{10} << 20);
  EXPECT_EQ(b.driver_free_memory(), std::size_t{54} << 20);
  EXPECT_EQ(b.free_memory(), b.driver_free_memory());
  b.free(p);
}

TEST(CudaExec, FreeMemoryOnAnIntegratedDeviceIsTheLargerOfDriverAndHost) {
  {
    FakeDevice small;  // the driver says less than the host has available
    small.integrated = true;
    small.total_memory = std::size_t{1} << 20;
    Rig rig({.devices = {small}});
    EXPECT_EQ(rig.b().driver_free_memory(), std::size_t{1} << 20);
    EXPECT_GT(rig.b().free_memory(), rig.b().driver_free_memory());
  }
  {
    FakeDevice huge;  // the driver says more than any host has
    huge.integrated = true;
    huge.total_memory = std::size_t{1} << 60;
    Rig rig({.devices = {huge}});
    EXPECT_EQ(rig.b().free_memory(), std::size_t{1} << 60);
  }
  {
    FakeDevice discrete;  // the same small figure on a discrete device is the driver's
    discrete.total_memory = std::size_t{1} << 20;
    Rig rig({.devices = {discrete}});
    EXPECT_EQ(rig.b().free_memory(), std::size_t{1} << 20);
  }
}

// ---- the sticky fault ----

TEST(CudaExec, AStickyFaultLatchesAndEveryLaterCallSaysTheDeviceIsFaulted) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& nop = b.op_cache().kernel(b, "core", "nop");
  const DevicePtr p = b.alloc(256);
  void* pinned = b.alloc_pinned(64);
  const StreamHandle s = b.create_stream();
  const EventHandle ev = b.create_event();
  rig.fd.set_sticky_fault(CUDA_ERROR_ILLEGAL_ADDRESS);
  LogCapture logs;
  const Error first = expect_error([&] { b.launch(nop, Dim3{}, Dim3{32}, 0, s, {}); });
  EXPECT_EQ(first.code(), ErrorCode::kDeviceFault);
  EXPECT_THAT(first.what(), HasSubstr("CUDA_ERROR_ILLEGAL_ADDRESS (700)"));
  EXPECT_TRUE(rig.host->faulted());
  EXPECT_EQ(logs.count(log::Level::kError,
                       "cuda: device 0 (Fake H200) is faulted: "
                       "CUDA_ERROR_ILLEGAL_ADDRESS"),
            1u);

  std::uint8_t host[16] = {};
  const auto expect_faulted = [&](const char* api, auto&& call) {
    SCOPED_TRACE(api);
    const Error e = expect_error(call);
    EXPECT_EQ(e.code(), ErrorCode::kDeviceFault);
    EXPECT_THAT(e.what(), HasSubstr(std::string("[") + api + "] the device is faulted"));
    EXPECT_THAT(e.what(), HasSubstr("restart the process"));
  };
  const auto driver_calls = rig.fd.total_calls();
  expect_faulted("alloc", [&] { b.alloc(64); });
  expect_faulted("alloc", [&] { b.alloc_pinned(64); });
  expect_faulted("copy_h2d", [&] { b.copy_h2d(p, host, 16); });
  expect_faulted("copy_d2h", [&] { b.copy_d2h(host, p, 16); });
  expect_faulted("copy_d2d", [&] { b.copy_d2d(p, p.offset(128), 16); });
  expect_faulted("memset", [&] { b.memset(p, 0, 16); });
  expect_faulted("launch", [&] { b.launch(nop, Dim3{}, Dim3{32}, 0, s, {}); });
  expect_faulted("synchronize", [&] { b.synchronize(s); });
  expect_faulted("synchronize_device", [&] { b.synchronize_device(); });
  expect_faulted("create_stream", [&] { b.create_stream(); });
  expect_faulted("record_event", [&] { b.record_event(ev, s); });
  expect_faulted("kernel", [&] { b.kernel("core", "fill_u32"); });
  EXPECT_EQ(rig.fd.total_calls(), driver_calls);  // refused before reaching the driver
  EXPECT_EQ(logs.count(log::Level::kError, "is faulted"), 1u);  // logged once

  // Freeing and teardown still work.
  EXPECT_NO_THROW(b.free(p));
  EXPECT_NO_THROW(b.free_pinned(pinned));
  EXPECT_NO_THROW(b.destroy_event(ev));
  EXPECT_NO_THROW(b.destroy_stream(s));
  b.alloc_report();
  rig.drop_all();
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaExec, AFaultedDeviceStillTearsDownLeftovers) {
  Rig rig;
  CudaBackend& b = rig.b();
  b.alloc(256);
  b.create_stream();
  b.create_event();
  rig.fd.set_sticky_fault(CUDA_ERROR_LAUNCH_FAILED);
  EXPECT_EQ(expect_error([&] { b.synchronize_device(); }).code(), ErrorCode::kDeviceFault);
  EXPECT_TRUE(rig.host->faulted());
  rig.drop_all();
  EXPECT_TRUE(rig.fd.outstanding().none());
}

}  // namespace
}  // namespace metrale::cuda::testing
