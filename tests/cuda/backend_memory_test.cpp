// The CUDA backend's memory rules on the fake driver
// (docs/CONTRACT.md, ledger; allocation fallback): the ledger and its call sites, managed memory,
// free and the sweep (context-gone statuses are not errors), out of memory and the managed-memory
// fallback, pinned host memory, and guard bands.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "cuda/status.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/weights.h"
#include "support/log_capture.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using metrale::testing::LogCapture;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::string site(int line) {
  return "backend_memory_test.cpp:" + std::to_string(line);
}

std::size_t warn_lines(const LogCapture& logs) {
  std::size_t n = 0;
  for (const auto& l : logs.lines()) n += l.level == log::Level::kWarn ? 1 : 0;
  return n;
}

// ---- alloc, alloc_managed, the ledger ----

TEST(CudaMemory, AllocGoesThroughCuMemAllocAndRecordsTheCallersLine) {
  Rig rig;
  const auto before = rig.fd.calls("cuMemAlloc");
  const int line = __LINE__ + 1;
  const DevicePtr p = rig.b().alloc(1000);
  ASSERT_TRUE(p);
  EXPECT_EQ(rig.fd.calls("cuMemAlloc"), before + 1);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 1000u);
  EXPECT_EQ(rig.fd.outstanding().allocations, 1u);
  EXPECT_EQ(rig.b().live_bytes(), 1000u);
  EXPECT_EQ(rig.b().live_alloc_count(), 1u);
  EXPECT_THAT(rig.b().alloc_report(), HasSubstr(site(line)));
  rig.b().free(p);
  EXPECT_EQ(rig.b().live_bytes(), 0u);
  EXPECT_EQ(rig.fd.outstanding().allocations, 0u);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 0u);
}

TEST(CudaMemory, AllocManagedUsesCuMemAllocManaged) {
  Rig rig;
  const auto plain = rig.fd.calls("cuMemAlloc");
  const DevicePtr p = rig.b().alloc_managed(4096);
  EXPECT_EQ(rig.fd.calls("cuMemAllocManaged"), 1u);
  EXPECT_EQ(rig.fd.calls("cuMemAlloc"), plain);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 0u);  // managed memory is not device memory
  EXPECT_EQ(rig.fd.outstanding().allocations, 1u);
  EXPECT_THAT(rig.b().alloc_report(), HasSubstr("4.0 KiB"));
  rig.b().free(p);
  EXPECT_EQ(rig.fd.outstanding().allocations, 0u);
}

TEST(CudaMemory, AllocManagedIsPlainDeviceMemoryWithoutManagedMemory) {
  FakeDevice dev;
  dev.managed_memory = false;
  Rig rig({.devices = {dev}});
  EXPECT_FALSE(rig.host->info().managed_memory);
  const auto plain = rig.fd.calls("cuMemAlloc");
  const DevicePtr p = rig.b().alloc_managed(4096);
  EXPECT_EQ(rig.fd.calls("cuMemAllocManaged"), 0u);
  EXPECT_EQ(rig.fd.calls("cuMemAlloc"), plain + 1);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 4096u);
  rig.b().free(p);
  EXPECT_EQ(rig.fd.outstanding().allocations, 0u);
}

TEST(CudaMemory, ZeroBytesIsRefusedBeforeTheDriver) {
  Rig rig;
  const auto before = rig.fd.calls("cuMemAlloc");
  const Error e = expect_error([&] { rig.b().alloc(0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[alloc] bytes = 0"));
  EXPECT_EQ(rig.fd.calls("cuMemAlloc"), before);
}

TEST(CudaMemory, AllocReportListsCallSitesLargestFirst) {
  Rig rig;
  const int small_line = __LINE__ + 1;
  const DevicePtr a = rig.b().alloc(1 * kMiB);
  const int big_line = __LINE__ + 1;
  const DevicePtr b = rig.b().alloc(3 * kMiB);
  const std::string report = rig.b().alloc_report();
  EXPECT_THAT(report, HasSubstr("4.0 MiB live in 2 allocation(s) from 2 call site(s)"));
  const auto big = report.find(site(big_line));
  const auto small = report.find(site(small_line));
  ASSERT_NE(big, std::string::npos) << report;
  ASSERT_NE(small, std::string::npos) << report;
  EXPECT_LT(big, small) << report;
  // top_n = 1 folds the smaller site.
  EXPECT_THAT(rig.b().alloc_report(1), HasSubstr("(1 more site(s))"));
  rig.b().free(a);
  rig.b().free(b);
}

// ---- free ----

TEST(CudaMemory, AFailedCuMemFreeStillTakesTheLedgerEntryOff) {
  Rig rig;
  const DevicePtr p = rig.b().alloc(256);
  rig.fd.fail_at("cuMemFree", rig.fd.calls("cuMemFree") + 1, CUDA_ERROR_INVALID_VALUE);
  const Error e = expect_error([&] { rig.b().free(p); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[free] cuMemFree failed: CUDA_ERROR_INVALID_VALUE (1): "
                                  "invalid argument"));
  EXPECT_EQ(rig.b().live_alloc_count(), 0u);
  EXPECT_EQ(rig.b().live_bytes(), 0u);
  // Off the ledger: a second free is a caller error, and the sweep does not free it again.
  const Error again = expect_error([&] { rig.b().free(p); });
  EXPECT_EQ(again.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(again.what(), HasSubstr("is not a live allocation of the cuda backend"));
  const auto frees = rig.fd.calls("cuMemFree");
  LogCapture logs;
  rig.backend.reset();
  EXPECT_EQ(rig.fd.calls("cuMemFree"), frees);
  EXPECT_EQ(logs.count(log::Level::kWarn, "sweep"), 0u);
}

TEST(CudaMemory, ContextGoneStatusesAreNotErrorsInFree) {
  Rig rig;
  for (CUresult gone :
       {CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_CONTEXT_IS_DESTROYED}) {
    SCOPED_TRACE(status_name(gone));
    const DevicePtr p = rig.b().alloc(128);
    rig.fd.fail_at("cuMemFree", rig.fd.calls("cuMemFree") + 1, gone);
    EXPECT_NO_THROW(rig.b().free(p));
    EXPECT_EQ(rig.b().live_alloc_count(), 0u);
  }
  // The same holds for pinned memory (cuMemFreeHost).
  void* h = rig.b().alloc_pinned(64);
  rig.fd.fail_at("cuMemFreeHost", rig.fd.calls("cuMemFreeHost") + 1, CUDA_ERROR_DEINITIALIZED);
  EXPECT_NO_THROW(rig.b().free_pinned(h));
  EXPECT_EQ(rig.b().live_alloc_count(), 0u);
}

TEST(CudaMemory, ContextGoneStatusesAreNotErrorsInTheSweep) {
  Rig rig;
  for (int i = 0; i < 3; ++i) rig.b().alloc(64);
  const auto frees = rig.fd.calls("cuMemFree");
  rig.fd.fail_at("cuMemFree", frees + 1, CUDA_ERROR_DEINITIALIZED);
  rig.fd.fail_at("cuMemFree", frees + 2, CUDA_ERROR_INVALID_CONTEXT);
  rig.fd.fail_at("cuMemFree", frees + 3, CUDA_ERROR_CONTEXT_IS_DESTROYED);
  LogCapture logs;
  EXPECT_EQ(rig.b().sweep_unreleased(), 3u);
  EXPECT_EQ(rig.fd.calls("cuMemFree"), frees + 3);
  EXPECT_EQ(warn_lines(logs), 1u);  // the sweep's own line; no "failed" line
  EXPECT_EQ(logs.count(log::Level::kWarn, "failed"), 0u);
  EXPECT_EQ(rig.b().live_alloc_count(), 0u);
}

TEST(CudaMemory, OtherSweepFailuresAreLoggedAndTheSweepGoesOn) {
  Rig rig;
  rig.b().alloc(64);
  rig.b().alloc(128);
  rig.fd.fail_at("cuMemFree", rig.fd.calls("cuMemFree") + 1, CUDA_ERROR_INVALID_VALUE);
  LogCapture logs;
  EXPECT_EQ(rig.b().sweep_unreleased(), 2u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "cuMemFree failed: CUDA_ERROR_INVALID_VALUE"), 1u);
  EXPECT_EQ(rig.fd.outstanding().allocations, 1u);  // the one whose free failed
  EXPECT_EQ(rig.b().live_alloc_count(), 0u);
}

TEST(CudaMemory, DestroyingTheBackendSweepsLeftoversWithOneWarningNamingTheSite) {
  Rig rig;
  const int line = __LINE__ + 1;
  rig.b().alloc(2 * kMiB);
  rig.b().alloc_managed(kMiB);
  void* pinned = rig.b().alloc_pinned(4096);
  ASSERT_NE(pinned, nullptr);
  EXPECT_EQ(rig.fd.outstanding().allocations, 2u);
  EXPECT_EQ(rig.fd.outstanding().host_allocs, 1u);
  LogCapture logs;
  rig.backend.reset();
  EXPECT_EQ(rig.fd.outstanding().allocations, 0u);
  EXPECT_EQ(rig.fd.outstanding().host_allocs, 0u);
  EXPECT_EQ(warn_lines(logs), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "cuda sweep: 3 allocation(s) never freed"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "2.0 MiB at " + site(line)), 1u);
}

TEST(CudaMemory, FreeingForeignOrInteriorPointersIsRefused) {
  Rig rig;
  const DevicePtr p = rig.b().alloc(256);
  const Error interior = expect_error([&] { rig.b().free(p.offset(16)); });
  EXPECT_EQ(interior.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(interior.what(), HasSubstr("not a live allocation"));
  EXPECT_NO_THROW(rig.b().free(DevicePtr{}));  // null is a no-op
  const Error kind = expect_error([&] { rig.b().free_pinned(host_view<void>(p)); });
  EXPECT_THAT(kind.what(), HasSubstr("free it with free"));
  rig.b().free(p);
}

// ---- out of memory and the managed-memory fallback ----

TEST(CudaMemory, OutOfDeviceMemoryIsOutOfMemoryNamingTheCall) {
  Rig rig;  // 1 GiB device
  const int line = __LINE__ + 1;
  const Error e = expect_error([&] { rig.b().alloc(std::size_t{2} << 30); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("[alloc]"));
  EXPECT_THAT(e.what(), HasSubstr("cuMemAlloc"));
  EXPECT_THAT(e.what(), HasSubstr("CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"));
  EXPECT_THAT(e.what(), HasSubstr(site(line)));
  EXPECT_EQ(rig.b().live_alloc_count(), 0u);
  EXPECT_EQ(rig.b().alloc_stats().failed_allocations, 1u);
  // What still fits is still given.
  const DevicePtr p = rig.b().alloc(kMiB);
  rig.b().free(p);
}

TEST(CudaMemory, WeightsFallBackToManagedMemoryOnceAndTheNextBackendTriesDeviceAgain) {
  FakeDevice dev;
  dev.total_memory = kMiB;
  Rig rig({.devices = {dev}});
  LogCapture logs;
  const DevicePtr big = alloc_weights(rig.b(), 2 * kMiB);
  EXPECT_TRUE(rig.b().op_cache().alloc_fell_back());
  EXPECT_EQ(rig.fd.calls("cuMemAllocManaged"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "managed memory from now on"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "CUDA_ERROR_OUT_OF_MEMORY"), 1u);
  // Latched: what would fit in device memory goes to managed memory too, without a warning.
  const auto plain = rig.fd.calls("cuMemAlloc");
  const DevicePtr small = alloc_weights(rig.b(), 4096);
  EXPECT_EQ(rig.fd.calls("cuMemAlloc"), plain);
  EXPECT_EQ(rig.fd.calls("cuMemAllocManaged"), 2u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "managed memory from now on"), 1u);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 0u);
  rig.b().free(big);
  rig.b().free(small);

  // The next model (a new backend, a new OpCache) tries device memory again.
  CudaBackend& next = rig.make_backend();
  EXPECT_FALSE(next.op_cache().alloc_fell_back());
  const DevicePtr w = alloc_weights(next, 4096);
  EXPECT_EQ(rig.fd.calls("cuMemAlloc"), plain + 1);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 4096u);
  EXPECT_FALSE(next.op_cache().alloc_fell_back());
  next.free(w);
}

TEST(CudaMemory, WeightsPropagateErrorsOtherThanOutOfMemory) {
  Rig rig;
  rig.fd.fail_at("cuMemAlloc", rig.fd.calls("cuMemAlloc") + 1, CUDA_ERROR_INVALID_VALUE);
  const Error e = expect_error([&] { alloc_weights(rig.b(), 4096); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_FALSE(rig.b().op_cache().alloc_fell_back());
  EXPECT_EQ(rig.fd.calls("cuMemAllocManaged"), 0u);
}

// ---- pinned host memory ----

TEST(CudaMemory, PinnedMemoryComesFromCuMemHostAllocAndMapsInteriorPointers) {
  Rig rig;
  const int line = __LINE__ + 1;
  auto* pinned = static_cast<std::byte*>(rig.b().alloc_pinned(4096));
  ASSERT_NE(pinned, nullptr);
  EXPECT_EQ(rig.fd.calls("cuMemHostAlloc"), 1u);
  EXPECT_EQ(rig.fd.outstanding().host_allocs, 1u);
  EXPECT_EQ(rig.b().live_bytes(), 4096u);  // pinned memory is on the ledger
  EXPECT_THAT(rig.b().alloc_report(), HasSubstr(site(line)));
  // The fake maps host memory at the same address (unified addressing).
  EXPECT_EQ(rig.b().pinned_device_address(pinned + 100),
            DevicePtr{reinterpret_cast<std::uintptr_t>(pinned + 100)});
  EXPECT_EQ(rig.b().pinned_device_address(pinned + 4095),
            DevicePtr{reinterpret_cast<std::uintptr_t>(pinned + 4095)});
  EXPECT_EQ(rig.fd.calls("cuMemHostGetDevicePointer"), 2u);
  rig.b().free_pinned(pinned);
  EXPECT_EQ(rig.fd.calls("cuMemFreeHost"), 1u);
  EXPECT_EQ(rig.fd.outstanding().host_allocs, 0u);
  EXPECT_EQ(rig.b().live_bytes(), 0u);
  // Freed: no longer pinned memory of this backend.
  const Error e = expect_error([&] { rig.b().pinned_device_address(pinned); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
}

TEST(CudaMemory, PinnedDeviceAddressOfOtherMemoryIsRefused) {
  Rig rig;
  auto* pinned = static_cast<std::byte*>(rig.b().alloc_pinned(256));
  std::vector<std::byte> pageable(256);
  const auto calls = rig.fd.calls("cuMemHostGetDevicePointer");
  for (const void* p :
       {static_cast<const void*>(pageable.data()), static_cast<const void*>(pinned - 1),
        static_cast<const void*>(pinned + 256)}) {  // one past the end
    const Error e = expect_error([&] { rig.b().pinned_device_address(p); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("[pinned_device_address] 0x"));
    EXPECT_THAT(e.what(), HasSubstr("is not inside pinned memory of this cuda backend"));
  }
  EXPECT_EQ(rig.fd.calls("cuMemHostGetDevicePointer"), calls);
  rig.b().free_pinned(pinned);
}

TEST(CudaMemory, CopyFromPinnedMemoryWaitsAndFromPageableMemoryDoesNot) {
  Rig rig;
  const DevicePtr dst = rig.b().alloc(256);
  auto* pinned = static_cast<std::uint8_t*>(rig.b().alloc_pinned(256));
  std::vector<std::uint8_t> pageable(256);
  for (std::size_t i = 0; i < 256; ++i) {
    pinned[i] = static_cast<std::uint8_t>(i);
    pageable[i] = static_cast<std::uint8_t>(255 - i);
  }
  const StreamHandle s = rig.b().default_stream();

  auto syncs = rig.fd.calls("cuStreamSynchronize");
  rig.b().copy_h2d_async(dst, pinned + 16, 128, s);  // interior of the pinned block
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs + 1);
  EXPECT_EQ(std::memcmp(host_view<std::uint8_t>(dst), pinned + 16, 128), 0);

  syncs = rig.fd.calls("cuStreamSynchronize");
  rig.b().copy_h2d_async(dst, pageable.data(), 256, s);
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs);
  EXPECT_EQ(std::memcmp(host_view<std::uint8_t>(dst), pageable.data(), 256), 0);

  // Inside a capture the copy is only recorded: no wait, which would break the capture.
  const StreamHandle cs = rig.b().create_stream();
  rig.b().begin_capture(cs);
  syncs = rig.fd.calls("cuStreamSynchronize");
  rig.b().copy_h2d_async(dst, pinned, 256, cs);
  EXPECT_EQ(rig.fd.calls("cuStreamSynchronize"), syncs);
  const GraphHandle g = rig.b().end_capture(cs);
  rig.b().launch_graph(g, cs);
  EXPECT_EQ(std::memcmp(host_view<std::uint8_t>(dst), pinned, 256), 0);
  rig.b().destroy_graph(g);
  rig.b().destroy_stream(cs);
  rig.b().free_pinned(pinned);
  rig.b().free(dst);
}

// ---- guard bands ----

TEST(CudaMemory, GuardBandsCatchAWritePastTheEndAndAreRefilled) {
  Rig rig;
  rig.b().set_guard_bands(GuardBandConfig{.pad_bytes = 32});
  const DevicePtr a = rig.b().alloc(100);  // allocation #0
  const DevicePtr b = rig.b().alloc(64);   // allocation #1
  // The pad is real device memory after the user bytes, filled with 0xEE.
  for (std::size_t i = 0; i < 32; ++i) EXPECT_EQ(host_view<std::uint8_t>(b)[64 + i], 0xEE) << i;
  EXPECT_EQ(rig.b().scan_redzones(), 0u);

  host_view<std::uint8_t>(b)[64 + 3] = 0x11;  // a kernel writing past the end of #1
  host_view<std::uint8_t>(b)[64 + 7] = 0x22;
  LogCapture logs;
  EXPECT_EQ(rig.b().scan_redzones(), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "guard band of allocation #1"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "2 byte(s) changed at pad offsets 3..7"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "first value 0x11"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocation #0"), 0u);
  // Refilled: a second scan is clean.
  EXPECT_EQ(host_view<std::uint8_t>(b)[64 + 3], 0xEE);
  EXPECT_EQ(rig.b().scan_redzones(), 0u);
  rig.b().free(a);
  rig.b().free(b);
}

TEST(CudaMemory, PoisonRedzonesBisectsByAllocationIndex) {
  Rig rig;
  rig.b().set_guard_bands(GuardBandConfig{.pad_bytes = 20});  // rounded up to 32
  std::vector<DevicePtr> p;
  for (int i = 0; i < 4; ++i) p.push_back(rig.b().alloc(48));
  rig.b().poison_redzones(1, 3);
  for (std::size_t i = 0; i < p.size(); ++i) {
    const std::uint8_t want = (i >= 1 && i < 3) ? 0xEE : 0x00;
    for (std::size_t k = 0; k < 32; ++k) {
      ASSERT_EQ(host_view<std::uint8_t>(p[i])[48 + k], want) << "allocation " << i << " byte " << k;
    }
  }
  // The scan checks against the poisoned fills.
  EXPECT_EQ(rig.b().scan_redzones(), 0u);
  host_view<std::uint8_t>(p[0])[48] = 0xEE;  // 0x00 is expected there now
  EXPECT_EQ(rig.b().scan_redzones(), 1u);
  for (DevicePtr q : p) rig.b().free(q);
}

TEST(CudaMemory, GuardBandsStartAtTheMinimumIndexAndSkipPinnedMemory) {
  Rig rig;
  rig.b().set_guard_bands(GuardBandConfig{.pad_bytes = 16, .min_index = 1});
  const DevicePtr a = rig.b().alloc(32);   // #0: no pad
  void* h = rig.b().alloc_pinned(32);      // pinned: never padded, takes no index
  const DevicePtr b = rig.b().alloc(32);   // #1: padded
  host_view<std::uint8_t>(a)[32 - 1] = 0;  // its own last byte
  EXPECT_EQ(rig.b().scan_redzones(), 0u);
  host_view<std::uint8_t>(b)[32] = 0;
  LogCapture logs;
  EXPECT_EQ(rig.b().scan_redzones(), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocation #1"), 1u);
  rig.b().free(a);
  rig.b().free(b);
  rig.b().free_pinned(h);
}

// ---- other threads ----

TEST(CudaMemory, FreeWorksOnAThreadThatNeverBound) {
  Rig rig;
  const DevicePtr p = rig.b().alloc(4096);
  void* h = rig.b().alloc_pinned(64);
  on_new_thread([&] {
    EXPECT_NO_THROW(rig.b().free(p));
    EXPECT_NO_THROW(rig.b().free_pinned(h));
  });
  EXPECT_EQ(rig.fd.outstanding().allocations, 0u);
  EXPECT_EQ(rig.fd.outstanding().host_allocs, 0u);
}

TEST(CudaMemory, AllocAndGuardScansWorkOnAnotherThread) {
  Rig rig;
  rig.b().set_guard_bands(GuardBandConfig{.pad_bytes = 16});
  DevicePtr p;
  on_new_thread([&] {
    p = rig.b().alloc(64);
    EXPECT_EQ(rig.b().scan_redzones(), 0u);
  });
  ASSERT_TRUE(p);
  host_view<std::uint8_t>(p)[64] = 0;
  on_new_thread([&] { EXPECT_EQ(rig.b().scan_redzones(), 1u); });
  rig.b().free(p);
}

// ---- borrowed memory ----

TEST(CudaMemory, ABorrowIsCheckedNeverFreedAndGivenBackAfterTheDeviceIsDone) {
  Rig rig;
  // Memory some other library allocated (the fake's device memory is host memory).
  std::vector<std::uint8_t> foreign(4096, 1);
  const DevicePtr p{reinterpret_cast<std::uintptr_t>(foreign.data())};
  std::uint64_t syncs_at_release = 0;
  int released = 0;
  const auto syncs = rig.fd.calls("cuCtxSynchronize");
  const auto frees = rig.fd.calls("cuMemFree");
  rig.b().borrow(p, foreign.size(), [&] {
    ++released;
    syncs_at_release = rig.fd.calls("cuCtxSynchronize");
  });
  EXPECT_EQ(rig.b().alloc_stats().borrowed_bytes, foreign.size());
  EXPECT_EQ(rig.b().live_bytes(), 0u);
  // The ledger now knows its bounds, where a foreign pointer was let through before.
  EXPECT_THAT(expect_error([&] { rig.b().check_range("op", "a", p.offset(4000), 97); }).what(),
              HasSubstr("overruns the allocation"));
  rig.b().check_range("op", "a", p.offset(4000), 96);
  EXPECT_THAT(expect_error([&] { rig.b().free(p); }).what(), HasSubstr("is borrowed memory"));
  rig.b().unborrow(p);
  EXPECT_EQ(released, 1);
  EXPECT_EQ(syncs_at_release, syncs + 1);  // the device was waited for before the release
  EXPECT_EQ(rig.fd.calls("cuMemFree"), frees);
  EXPECT_EQ(rig.b().alloc_stats().borrowed_count, 0u);
}

}  // namespace
}  // namespace metrale::cuda::testing
