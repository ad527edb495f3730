// Lazy buffers on the CUDA backend, run on the fake driver's virtual memory: the calls a growth
// and a release make, data kept across growth, ops on lazy memory, every refusal with nothing
// left in the driver, and every new call failed at every position of a reserve-grow-release.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/lazy_buffer.h"
#include "metrale/ops/elementwise.h"
#include "support/log_capture.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using metrale::testing::LogCapture;
using ::testing::HasSubstr;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGranule = 2 * kMiB;

std::string str(const FakeOutstanding& o) {
  return fmt::format("reservations {}, vmm handles {}, mappings {}, allocations {}", o.reservations,
                     o.vmm_handles, o.mappings, o.allocations);
}

// Nothing of the virtual memory calls is left (the rig's own modules and streams live on).
bool vmm_clear(const FakeOutstanding& o) {
  return o.reservations == 0 && o.vmm_handles == 0 && o.mappings == 0 && o.allocations == 0;
}

TEST(CudaLazy, GrowthMapsOnePhysicalAllocationAndKeepsData) {
  Rig rig;
  CudaBackend& b = rig.b();
  LazyBuffer buf = b.reserve_lazy(16 * kMiB, "kv");
  EXPECT_EQ(buf.granularity(), kGranule);
  EXPECT_EQ(rig.fd.calls("cuMemAddressReserve"), 1u);
  EXPECT_EQ(rig.fd.outstanding().reservations, 1u);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 0u);  // address space is not memory
  const DevicePtr base = buf.base();
  EXPECT_EQ(buf.grow(3 * kMiB), 4 * kMiB);
  EXPECT_EQ(rig.fd.calls("cuMemCreate"), 1u);
  EXPECT_EQ(rig.fd.calls("cuMemMap"), 1u);
  EXPECT_EQ(rig.fd.calls("cuMemSetAccess"), 1u);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 4 * kMiB);
  const std::uint32_t first[3] = {7, 8, 9};
  b.copy_h2d(base, first, sizeof first);
  EXPECT_EQ(buf.grow(16 * kMiB), 16 * kMiB);
  EXPECT_EQ(buf.base(), base);
  std::uint32_t back[3] = {};
  b.copy_d2h(back, base, sizeof back);
  EXPECT_EQ(back[2], 9u);
  // A copy across the two physical allocations is one range to the driver and the ledger.
  std::vector<std::uint8_t> across(kMiB, 0x5a);
  b.copy_h2d(base.offset(4 * kMiB - kMiB / 2), across.data(), across.size());
  EXPECT_EQ(b.live_bytes(), 16 * kMiB);
  EXPECT_EQ(rig.fd.outstanding().vmm_handles, 2u);
  EXPECT_EQ(rig.fd.outstanding().mappings, 2u);
  buf.release();
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(b.live_alloc_count(), 0u);
  EXPECT_TRUE(vmm_clear(rig.fd.outstanding())) << str(rig.fd.outstanding());
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 0u);
}

TEST(CudaLazy, OpsRunOnLazyMemoryAndBeyondMappedIsRefused) {
  Rig rig;
  CudaBackend& b = rig.b();
  LazyBuffer buf = b.reserve_lazy(8 * kMiB, "scratch");
  buf.grow(2 * kGranule);
  const StreamHandle s = b.default_stream();
  const std::size_t n = 1024;
  const DevicePtr y = buf.base().offset(kGranule - 2048);  // across the two granules
  const DevicePtr x = buf.base().offset(3 * kMiB);
  ops::fill_u32(b, s, y, n, 0x3f800000u);  // 1.0f
  ops::fill_u32(b, s, x, n, 0x40000000u);  // 2.0f
  ops::axpy_f32(b, s, y, x, 3.0f, n);
  std::vector<float> out(n);
  b.copy_d2h(out.data(), y, n * 4);
  for (float v : out) ASSERT_EQ(v, 7.0f);
  const Error e = expect_error([&] { ops::fill_u32(b, s, buf.base().offset(4 * kMiB), 4, 0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("+ 16 bytes lies beyond the {} mapped bytes of lazy "
                                              "buffer 'scratch'",
                                              4 * kMiB)));
  buf.release();
  EXPECT_TRUE(vmm_clear(rig.fd.outstanding())) << str(rig.fd.outstanding());
}

TEST(CudaLazy, RefusalsNameTheCallAndLeaveNothing) {
  Rig rig;
  CudaBackend& b = rig.b();
  const Error tiny = expect_error([&] { (void)b.reserve_lazy(kMiB, "tiny"); });
  EXPECT_EQ(tiny.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(tiny.what(), HasSubstr("[reserve_lazy] budget_bytes = 1048576 for 'tiny'"));
  EXPECT_THAT(tiny.what(), HasSubstr("below one granule of the cuda backend (2097152 bytes)"));
  EXPECT_EQ(rig.fd.calls("cuMemAddressReserve"), 0u);

  LazyBuffer buf = b.reserve_lazy(4 * kMiB, "kv");
  buf.grow(kGranule);
  const Error past = expect_error([&] { buf.grow(6 * kMiB); });
  EXPECT_EQ(past.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(past.what(), HasSubstr("[LazyBuffer::grow] bytes = 6291456 is past the budget of "
                                     "lazy buffer 'kv'"));

  const StreamHandle side = b.create_stream();
  b.begin_capture(side);
  const Error cap = expect_error([&] { buf.grow(4 * kMiB); });
  EXPECT_EQ(cap.code(), ErrorCode::kCapture);
  EXPECT_THAT(cap.what(), HasSubstr("a stream of the cuda backend is capturing"));
  b.abort_capture(side);
  b.destroy_stream(side);

  {
    LogCapture quiet(log::Level::kError);
    setenv("METRALE_LAZY_FREE_FLOOR_MB", "1023", 1);  // the fake has 1 GiB, 2 MiB in use
    const Error floor = expect_error([&] { buf.grow(4 * kMiB); });
    unsetenv("METRALE_LAZY_FREE_FLOOR_MB");
    EXPECT_EQ(floor.code(), ErrorCode::kOutOfMemory);
    EXPECT_THAT(floor.what(), HasSubstr("would leave 1020.0 MiB of device memory free (1022.0 MiB "
                                        "free now), below the floor of 1023.0 MiB set by "
                                        "METRALE_LAZY_FREE_FLOOR_MB"));
  }
  EXPECT_EQ(buf.mapped_bytes(), kGranule);
  EXPECT_EQ(rig.fd.calls("cuMemCreate"), 1u);  // no refusal reached the driver
  EXPECT_EQ(rig.fd.outstanding().mappings, 1u);

  buf.release();
  const Error twice = expect_error([&] { buf.release(); });
  EXPECT_EQ(twice.code(), ErrorCode::kState);
  EXPECT_THAT(twice.what(), HasSubstr("[LazyBuffer::release] lazy buffer 'kv'"));
  EXPECT_EQ(rig.fd.calls("cuMemAddressFree"), 1u);
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_TRUE(vmm_clear(rig.fd.outstanding())) << str(rig.fd.outstanding());
}

// The fake's own rules, which a driver would enforce on a caller that broke them.
TEST(CudaLazy, TheFakeKeepsTheDriversOrderRules) {
  Rig rig;
  const DriverApi& api = rig.table;
  CUdeviceptr va = 0;
  ASSERT_EQ(api.cuMemAddressReserve(&va, 4 * kMiB, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_EQ(va % kGranule, 0u);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h = 0;
  EXPECT_EQ(api.cuMemCreate(&h, kMiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);  // not a granule
  ASSERT_EQ(api.cuMemCreate(&h, kGranule, &prop, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemMap(va + 4096, kGranule, 0, h, 0), CUDA_ERROR_INVALID_VALUE);      // unaligned
  EXPECT_EQ(api.cuMemMap(va + 4 * kMiB, kGranule, 0, h, 0), CUDA_ERROR_INVALID_VALUE);  // outside
  ASSERT_EQ(api.cuMemMap(va, kGranule, 0, h, 0), CUDA_SUCCESS);
  CUmemGenericAllocationHandle h2 = 0;
  ASSERT_EQ(api.cuMemCreate(&h2, kGranule, &prop, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemMap(va, kGranule, 0, h2, 0), CUDA_ERROR_INVALID_VALUE);  // overlap
  EXPECT_EQ(api.cuMemRelease(h2), CUDA_SUCCESS);
  // Mapped but without access: not memory yet.
  std::uint32_t word = 1;
  EXPECT_EQ(api.cuMemcpyHtoDAsync(va, &word, 4, nullptr), CUDA_ERROR_INVALID_VALUE);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(api.cuMemSetAccess(va, kGranule, &access, 1), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemcpyHtoDAsync(va, &word, 4, nullptr), CUDA_SUCCESS);
  // A handle released while mapped lives until unmapped; the range cannot be freed before.
  EXPECT_EQ(api.cuMemRelease(h), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(rig.fd.outstanding().vmm_handles, 1u);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), kGranule);
  EXPECT_EQ(api.cuMemAddressFree(va, 4 * kMiB), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemUnmap(va, kMiB), CUDA_ERROR_INVALID_VALUE);  // part of a mapping
  EXPECT_EQ(api.cuMemUnmap(va, kGranule), CUDA_SUCCESS);
  EXPECT_EQ(rig.fd.outstanding().vmm_handles, 0u);
  EXPECT_EQ(api.cuMemAddressFree(va, kGranule), CUDA_ERROR_INVALID_VALUE);  // not the whole range
  EXPECT_EQ(api.cuMemAddressFree(va, 4 * kMiB), CUDA_SUCCESS);
  EXPECT_TRUE(vmm_clear(rig.fd.outstanding())) << str(rig.fd.outstanding());
}

TEST(CudaLazy, TheFakeRefusesMappingWhileAStreamCaptures) {
  Rig rig;
  CudaBackend& b = rig.b();
  const DriverApi& api = rig.table;
  CUdeviceptr va = 0;
  ASSERT_EQ(api.cuMemAddressReserve(&va, kGranule, 0, 0, 0), CUDA_SUCCESS);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemGenericAllocationHandle h = 0;
  ASSERT_EQ(api.cuMemCreate(&h, kGranule, &prop, 0), CUDA_SUCCESS);
  const StreamHandle side = b.create_stream();
  b.begin_capture(side);
  EXPECT_EQ(api.cuMemMap(va, kGranule, 0, h, 0), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  b.abort_capture(side);
  EXPECT_EQ(api.cuMemMap(va, kGranule, 0, h, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemUnmap(va, kGranule), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemRelease(h), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemAddressFree(va, kGranule), CUDA_SUCCESS);
  b.destroy_stream(side);
}

// reserve, grow by two granules, grow by three more, write, release: the scenario the sweep
// fails at every position of every new call.
constexpr const char* kGrowCalls[] = {"cuMemGetAllocationGranularity", "cuMemAddressReserve",
                                      "cuMemCreate", "cuMemMap", "cuMemSetAccess"};
constexpr const char* kReleaseCalls[] = {"cuMemUnmap", "cuMemRelease", "cuMemAddressFree"};

TEST(CudaLazyFaultSweep, EveryNewCallFailsCleanlyAtEveryPosition) {
  std::map<std::string, std::uint64_t> counts;
  {
    Rig rig;
    LazyBuffer buf = rig.b().reserve_lazy(10 * kMiB, "kv");
    buf.grow(2 * kGranule);
    buf.grow(10 * kMiB);
    buf.release();
    for (const char* c : kGrowCalls) counts[c] = rig.fd.calls(c);
    for (const char* c : kReleaseCalls) counts[c] = rig.fd.calls(c);
  }
  std::size_t positions = 0;
  for (const auto& [call, count] : counts) {
    ASSERT_GT(count, 0u) << call;
    for (std::uint64_t nth = 1; nth <= count; ++nth) {
      const std::string where = fmt::format("{} #{} of {}", call, nth, count);
      ++positions;
      Rig rig;
      CudaBackend& b = rig.b();
      LogCapture logs(log::Level::kWarn);
      rig.fd.fail_at(call, nth, CUDA_ERROR_OUT_OF_MEMORY);
      std::string error;
      LazyBuffer buf;
      std::size_t before = 0;
      try {
        buf = b.reserve_lazy(10 * kMiB, "kv");
        before = buf.mapped_bytes();
        buf.grow(2 * kGranule);
        before = buf.mapped_bytes();
        buf.grow(10 * kMiB);
        before = buf.mapped_bytes();
        buf.release();
      } catch (const Error& e) {
        error = e.what();
      }
      ASSERT_THAT(error, HasSubstr(call)) << where;
      if (buf.live()) {
        // A growth failed: it undid itself, the buffer kept its size, and it still works.
        EXPECT_EQ(buf.mapped_bytes(), before) << where;
        EXPECT_EQ(b.live_bytes(), before) << where;
        EXPECT_EQ(rig.fd.device_bytes_in_use(), before) << where;
        EXPECT_EQ(rig.fd.outstanding().mappings, before == 0 ? 0u : 1u) << where;
        rig.fd.clear_failures();
        EXPECT_EQ(buf.grow(10 * kMiB), 10 * kMiB) << where;
        buf.release();
      } else if (std::string(call).starts_with("cuMemGet") ||
                 std::string(call) == "cuMemAddressReserve") {
        EXPECT_FALSE(buf.base()) << where;  // the reservation itself failed: no buffer
      } else {
        // The release failed at call: every later step was still tried, once.
        EXPECT_EQ(rig.fd.calls("cuMemAddressFree"), 1u) << where;
        EXPECT_EQ(rig.fd.calls("cuMemRelease"), 2u) << where;
        EXPECT_EQ(rig.fd.calls("cuMemUnmap"), 2u) << where;
        EXPECT_THAT(error, HasSubstr("[LazyBuffer::release]")) << where;
      }
      EXPECT_EQ(b.live_bytes(), 0u) << where;
      EXPECT_EQ(b.live_alloc_count(), 0u) << where;
      if (buf.base()) {  // whatever failed, a second release frees nothing and says so
        const Error again = expect_error([&] { buf.release(); });
        EXPECT_EQ(again.code(), ErrorCode::kState) << where;
      }
    }
  }
  EXPECT_GE(positions, 12u);
}

// What the driver keeps when a release step fails is what the step left; the steps after it ran.
TEST(CudaLazyFaultSweep, AFailedUnmapLeavesOnlyWhatItHeld) {
  Rig rig;
  LazyBuffer buf = rig.b().reserve_lazy(8 * kMiB, "kv");
  buf.grow(kGranule);
  buf.grow(8 * kMiB);
  rig.fd.fail_at("cuMemUnmap", 1, CUDA_ERROR_INVALID_VALUE);  // the newer piece
  const Error e = expect_error([&] { buf.release(); });
  EXPECT_THAT(e.what(), HasSubstr("[LazyBuffer::release] cuMemUnmap failed: "));
  // The older piece is gone; the newer one's handle is released but lives while mapped, so the
  // reservation cannot be freed either: one mapping, one handle, one reservation left.
  const FakeOutstanding o = rig.fd.outstanding();
  EXPECT_EQ(o.mappings, 1u);
  EXPECT_EQ(o.vmm_handles, 1u);
  EXPECT_EQ(o.reservations, 1u);
  EXPECT_EQ(rig.b().live_bytes(), 0u);
}

TEST(CudaLazyFaultSweep, AFailedSynchronizeStillReleasesEverything) {
  Rig rig;
  LazyBuffer buf = rig.b().reserve_lazy(4 * kMiB, "kv");
  buf.grow(kGranule);
  rig.fd.fail_at("cuCtxSynchronize", rig.fd.calls("cuCtxSynchronize") + 1, CUDA_ERROR_UNKNOWN);
  const Error e = expect_error([&] { buf.release(); });
  EXPECT_THAT(e.what(), HasSubstr("cuCtxSynchronize"));
  EXPECT_TRUE(vmm_clear(rig.fd.outstanding())) << str(rig.fd.outstanding());
  EXPECT_EQ(rig.b().live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale::cuda::testing
