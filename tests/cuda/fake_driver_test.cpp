// The fake CUDA driver on its own: it must answer like the driver, since every CUDA backend
// test trusts it. Each test drives the table exactly as backend code would.
#include "cuda/fake_driver.h"

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
#include "cuda/status.h"

namespace metrale::cuda::testing {
namespace {

using Bytes = std::vector<std::uint8_t>;
constexpr std::size_t kMiB = std::size_t{1} << 20;

// A fake with cuInit done and device 0's primary context retained and current.
struct Ready {
  explicit Ready(std::vector<FakeDevice> devices = {FakeDevice{}}) : fake(std::move(devices)) {
    EXPECT_EQ(api().cuInit(0), CUDA_SUCCESS);
    EXPECT_EQ(api().cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
    EXPECT_EQ(api().cuCtxSetCurrent(ctx), CUDA_SUCCESS);
  }
  const DriverApi& api() const { return fake.api(); }

  CUdeviceptr alloc(std::size_t n) {
    CUdeviceptr p = 0;
    EXPECT_EQ(api().cuMemAlloc(&p, n), CUDA_SUCCESS);
    return p;
  }
  void write(CUdeviceptr p, const Bytes& bytes) {
    EXPECT_EQ(api().cuMemcpyHtoDAsync(p, bytes.data(), bytes.size(), nullptr), CUDA_SUCCESS);
  }
  Bytes read(CUdeviceptr p, std::size_t n) {
    Bytes out(n, 0);
    EXPECT_EQ(api().cuMemcpyDtoHAsync(out.data(), p, n, nullptr), CUDA_SUCCESS);
    return out;
  }
  CUstream stream(unsigned flags = CU_STREAM_NON_BLOCKING) {
    CUstream s = nullptr;
    EXPECT_EQ(api().cuStreamCreate(&s, flags), CUDA_SUCCESS);
    return s;
  }
  CUstreamCaptureStatus capture_status(CUstream s) {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    EXPECT_EQ(api().cuStreamIsCapturing(s, &status), CUDA_SUCCESS);
    return status;
  }
  // Registers `module` as "m", loads it, and returns entry `name` (module handle in *mod).
  CUfunction function(FakeModule module, const char* name, CUmodule* mod = nullptr) {
    fake.add_module("m", std::move(module));
    const auto image = FakeDriver::fake_image("m");
    CUmodule m = nullptr;
    CUfunction f = nullptr;
    EXPECT_EQ(api().cuModuleLoadData(&m, image.data()), CUDA_SUCCESS);
    EXPECT_EQ(api().cuModuleGetFunction(&f, m, name), CUDA_SUCCESS);
    if (mod != nullptr) *mod = m;
    return f;
  }
  CUresult launch(CUfunction f, CUstream s, void** params, unsigned shared = 0) {
    return api().cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, shared, s, params, nullptr);
  }

  FakeDriver fake;
  CUcontext ctx = nullptr;
};

// A module with entry "k" whose body counts its runs and, given (CUdeviceptr p, uint32 n)
// parameters, fills n bytes at p with 0x7F through the host address.
FakeModule filler(int* runs, bool declare_sizes = false) {
  FakeModule m;
  m.functions["k"].body = [runs](const FakeLaunch& l) {
    ++*runs;
    if (l.params == nullptr) return;
    CUdeviceptr p = 0;
    std::uint32_t n = 0;
    std::memcpy(&p, l.params[0], sizeof p);
    std::memcpy(&n, l.params[1], sizeof n);
    std::memset(reinterpret_cast<void*>(static_cast<std::uintptr_t>(p)), 0x7F, n);
  };
  if (declare_sizes) m.functions["k"].param_sizes = {sizeof(CUdeviceptr), sizeof(std::uint32_t)};
  return m;
}

// ---- construction and initialisation ----

TEST(FakeDriver, FillsEveryTableEntry) {
  FakeDriver fake;
#define METRALE_EXPECT_FILLED(name, version) EXPECT_NE(fake.api().name, nullptr) << #name;
  METRALE_DRIVER_FUNCTIONS(METRALE_EXPECT_FILLED)
#undef METRALE_EXPECT_FILLED
}

TEST(FakeDriver, SecondLiveFakeThrowsLogicError) {
  FakeDriver first;
  EXPECT_THROW(FakeDriver second, std::logic_error);
  EXPECT_EQ(first.api().cuInit(0), CUDA_SUCCESS);  // the first is unharmed
}

TEST(FakeDriver, DestructorFreesLeftoversAndDisconnectsTheTable) {
  DriverApi table;
  {
    Ready r;
    r.alloc(1000);
    void* host = nullptr;
    EXPECT_EQ(r.api().cuMemHostAlloc(&host, 64, 0), CUDA_SUCCESS);
    r.fake.add_module("m", FakeModule{}.publish_u32("g", 1));
    CUmodule m = nullptr;
    EXPECT_EQ(r.api().cuModuleLoadData(&m, FakeDriver::fake_image("m").data()), CUDA_SUCCESS);
    r.stream();
    CUevent e = nullptr;
    EXPECT_EQ(r.api().cuEventCreate(&e, 0), CUDA_SUCCESS);
    EXPECT_FALSE(r.fake.outstanding().none());
    table = r.api();
  }  // leak checking (LSan) proves the memory went back
  EXPECT_EQ(table.cuInit(0), CUDA_ERROR_DEINITIALIZED);
  FakeDriver next;  // a new fake may follow
  EXPECT_EQ(next.api().cuInit(0), CUDA_SUCCESS);
}

TEST(FakeDriver, CallsBeforeCuInitAreNotInitialized) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  int count = -1;
  CUdevice dev = -1;
  CUcontext ctx = nullptr;
  CUdeviceptr p = 0;
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(api.cuDeviceGet(&dev, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(api.cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(api.cuMemAlloc(&p, 16), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(count, -1);
  EXPECT_EQ(ctx, nullptr);
  // These four work before cuInit, as in the driver.
  int version = 0;
  const char* text = nullptr;
  EXPECT_EQ(api.cuDriverGetVersion(&version), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &text), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGetErrorString(CUDA_ERROR_NOT_INITIALIZED, &text), CUDA_SUCCESS);
  EXPECT_EQ(api.cuInit(0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_SUCCESS);
  EXPECT_EQ(count, 1);
}

TEST(FakeDriver, CuInitReturnsTheConfiguredStatus) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  fake.set_init_status(CUDA_ERROR_STUB_LIBRARY);
  EXPECT_EQ(api.cuInit(0), CUDA_ERROR_STUB_LIBRARY);
  int count = -1;
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
  fake.set_init_status(CUDA_SUCCESS);
  EXPECT_EQ(api.cuInit(1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuInit(0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_SUCCESS);
}

TEST(FakeDriver, DriverVersionDefaultsTo13000) {
  FakeDriver fake;
  int version = 0;
  EXPECT_EQ(fake.api().cuDriverGetVersion(&version), CUDA_SUCCESS);
  EXPECT_EQ(version, 13000);
  fake.set_driver_version(12080);
  EXPECT_EQ(fake.api().cuDriverGetVersion(&version), CUDA_SUCCESS);
  EXPECT_EQ(version, 12080);
  EXPECT_EQ(fake.api().cuDriverGetVersion(nullptr), CUDA_ERROR_INVALID_VALUE);
}

TEST(FakeDriver, NamesAndDescribesStatuses) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  const char* text = nullptr;
  EXPECT_EQ(api.cuGetErrorName(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, &text), CUDA_SUCCESS);
  EXPECT_STREQ(text, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED");
  EXPECT_EQ(api.cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &text), CUDA_SUCCESS);
  EXPECT_STREQ(text, "out of memory");
  EXPECT_EQ(api.cuGetErrorString(CUDA_ERROR_ECC_UNCORRECTABLE, &text), CUDA_SUCCESS);
  EXPECT_STREQ(text, "an error reported by the fake CUDA driver");
  const auto unknown = static_cast<CUresult>(998);
  EXPECT_EQ(api.cuGetErrorName(unknown, &text), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(text, nullptr);
  EXPECT_EQ(api.cuGetErrorString(unknown, &text), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(text, nullptr);
  EXPECT_EQ(describe_status(&api, CUDA_ERROR_OUT_OF_MEMORY),
            "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory");
}

// ---- devices and contexts ----

TEST(FakeDriver, ReportsDevices) {
  FakeDevice orin{"Fake Orin", 8, 7, 16, 64 * kMiB, true, false};
  Ready r({FakeDevice{}, orin});
  const DriverApi& api = r.api();
  int count = 0;
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_SUCCESS);
  EXPECT_EQ(count, 2);
  CUdevice dev = -1;
  EXPECT_EQ(api.cuDeviceGet(&dev, 1), CUDA_SUCCESS);
  EXPECT_EQ(dev, 1);
  EXPECT_EQ(api.cuDeviceGet(&dev, 2), CUDA_ERROR_INVALID_DEVICE);
  char name[64] = {};
  EXPECT_EQ(api.cuDeviceGetName(name, static_cast<int>(sizeof name), 0), CUDA_SUCCESS);
  EXPECT_STREQ(name, "Fake H200");
  EXPECT_EQ(api.cuDeviceGetName(name, 5, 1), CUDA_SUCCESS);  // truncated, NUL-terminated
  EXPECT_STREQ(name, "Fake");

  auto attr = [&](CUdevice_attribute a, CUdevice d) {
    int v = -1;
    EXPECT_EQ(api.cuDeviceGetAttribute(&v, a, d), CUDA_SUCCESS) << a;
    return v;
  };
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0), 9);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0), 0);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0), 132);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_INTEGRATED, 0), 0);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 0), 1);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, 0), 232448);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 1), 8);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 1), 7);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 1), 16);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_INTEGRATED, 1), 1);
  EXPECT_EQ(attr(CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1), 0);
  int v = -1;
  EXPECT_EQ(api.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 2),
            CUDA_ERROR_INVALID_DEVICE);

  std::size_t total = 0;
  EXPECT_EQ(api.cuDeviceTotalMem(&total, 0), CUDA_SUCCESS);
  EXPECT_EQ(total, std::size_t{1} << 30);
  EXPECT_EQ(api.cuDeviceTotalMem(&total, 1), CUDA_SUCCESS);
  EXPECT_EQ(total, 64 * kMiB);
}

TEST(FakeDriver, NoDevicesMeansCountZero) {
  FakeDriver fake(std::vector<FakeDevice>{});
  EXPECT_EQ(fake.api().cuInit(0), CUDA_SUCCESS);
  int count = -1;
  CUdevice dev = -1;
  EXPECT_EQ(fake.api().cuDeviceGetCount(&count), CUDA_SUCCESS);
  EXPECT_EQ(count, 0);
  EXPECT_EQ(fake.api().cuDeviceGet(&dev, 0), CUDA_ERROR_INVALID_DEVICE);
}

TEST(FakeDriver, CountsPrimaryContextRetains) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  ASSERT_EQ(api.cuInit(0), CUDA_SUCCESS);
  CUcontext a = nullptr, b = nullptr;
  EXPECT_EQ(api.cuDevicePrimaryCtxRetain(&a, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDevicePrimaryCtxRetain(&b, 0), CUDA_SUCCESS);
  EXPECT_NE(a, nullptr);
  EXPECT_EQ(a, b);  // one primary context per device
  EXPECT_EQ(fake.outstanding().contexts, 2u);
  EXPECT_EQ(api.cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
  EXPECT_EQ(fake.outstanding().contexts, 1u);
  EXPECT_EQ(api.cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
  EXPECT_EQ(api.cuDevicePrimaryCtxRelease(1), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_TRUE(fake.outstanding().none());
}

TEST(FakeDriver, ContextCallsNeedALiveCurrentContextOnTheCallingThread) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  ASSERT_EQ(api.cuInit(0), CUDA_SUCCESS);
  CUdeviceptr p = 0;
  EXPECT_EQ(api.cuMemAlloc(&p, 16), CUDA_ERROR_INVALID_CONTEXT);
  CUcontext ctx = nullptr;
  ASSERT_EQ(api.cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemAlloc(&p, 16), CUDA_ERROR_INVALID_CONTEXT);  // retained, not current
  EXPECT_EQ(api.cuCtxSetCurrent(reinterpret_cast<CUcontext>(std::uintptr_t{0x40})),
            CUDA_ERROR_INVALID_CONTEXT);
  ASSERT_EQ(api.cuCtxSetCurrent(ctx), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemAlloc(&p, 16), CUDA_SUCCESS);
  CUresult other_thread = CUDA_SUCCESS;
  std::thread([&] {
    CUdeviceptr q = 0;
    other_thread = api.cuMemAlloc(&q, 16);
  }).join();
  EXPECT_EQ(other_thread, CUDA_ERROR_INVALID_CONTEXT);  // current is per thread
  EXPECT_EQ(api.cuMemFree(p), CUDA_SUCCESS);
  ASSERT_EQ(api.cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemAlloc(&p, 16), CUDA_ERROR_INVALID_CONTEXT);  // released: not live
}

// ---- memory ----

TEST(FakeDriver, AllocationBeyondTotalMemoryIsOutOfMemory) {
  FakeDevice small;
  small.total_memory = kMiB;
  Ready r({small});
  const DriverApi& api = r.api();
  const CUdeviceptr a = r.alloc(768 * 1024);
  CUdeviceptr p = 0;
  EXPECT_EQ(api.cuMemAlloc(&p, 512 * 1024), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(p, 0u);
  EXPECT_EQ(r.fake.device_bytes_in_use(), 768u * 1024);
  std::size_t free_bytes = 0, total = 0;
  EXPECT_EQ(api.cuMemGetInfo(&free_bytes, &total), CUDA_SUCCESS);
  EXPECT_EQ(total, kMiB);
  EXPECT_EQ(free_bytes, 256u * 1024);
  const CUdeviceptr b = r.alloc(256 * 1024);  // exactly what is left
  EXPECT_EQ(api.cuMemAlloc(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(api.cuMemFree(a), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.device_bytes_in_use(), 256u * 1024);
  EXPECT_EQ(api.cuMemGetInfo(&free_bytes, &total), CUDA_SUCCESS);
  EXPECT_EQ(free_bytes, 768u * 1024);
  EXPECT_EQ(api.cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemFree(b), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.device_bytes_in_use(), 0u);
}

TEST(FakeDriver, FreeOfAnythingButALiveBaseIsInvalidValue) {
  Ready r;
  const DriverApi& api = r.api();
  const CUdeviceptr p = r.alloc(1024);
  EXPECT_EQ(api.cuMemFree(p + 256), CUDA_ERROR_INVALID_VALUE);  // interior
  EXPECT_EQ(api.cuMemFree(0x1234), CUDA_ERROR_INVALID_VALUE);   // never allocated
  EXPECT_EQ(api.cuMemFree(0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemFree(p), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(p), CUDA_ERROR_INVALID_VALUE);  // already freed
  EXPECT_EQ(r.fake.outstanding().allocations, 0u);
}

TEST(FakeDriver, AllocationsAre256ByteAlignedAndDisjoint) {
  Ready r;
  const std::vector<std::size_t> sizes{1, 3, 255, 256, 257, 1000, 4096};
  std::vector<CUdeviceptr> ptrs;
  for (std::size_t n : sizes) ptrs.push_back(r.alloc(n));
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    EXPECT_EQ(ptrs[i] % 256, 0u) << "size " << sizes[i];
    for (std::size_t j = 0; j < i; ++j) {
      EXPECT_TRUE(ptrs[i] + sizes[i] <= ptrs[j] || ptrs[j] + sizes[j] <= ptrs[i]);
    }
  }
  EXPECT_EQ(r.fake.outstanding().allocations, sizes.size());
  for (CUdeviceptr p : ptrs) EXPECT_EQ(r.api().cuMemFree(p), CUDA_SUCCESS);
}

TEST(FakeDriver, ManagedMemoryIsCountedButNotAgainstDeviceMemory) {
  Ready r;
  const DriverApi& api = r.api();
  CUdeviceptr m = 0;
  EXPECT_EQ(api.cuMemAllocManaged(&m, 1000, 0), CUDA_ERROR_INVALID_VALUE);  // flags required
  EXPECT_EQ(api.cuMemAllocManaged(&m, 1000, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS);
  EXPECT_EQ(m % 256, 0u);
  EXPECT_EQ(r.fake.outstanding().allocations, 1u);
  EXPECT_EQ(r.fake.device_bytes_in_use(), 0u);
  std::size_t free_bytes = 0, total = 0;
  EXPECT_EQ(api.cuMemGetInfo(&free_bytes, &total), CUDA_SUCCESS);
  EXPECT_EQ(free_bytes, total);
  r.write(m + 10, {1, 2, 3});
  EXPECT_EQ(r.read(m + 10, 3), (Bytes{1, 2, 3}));
  EXPECT_EQ(api.cuMemFree(m), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().allocations, 0u);
}

TEST(FakeDriver, ManagedMemoryNeedsTheDeviceAttribute) {
  FakeDevice no_managed;
  no_managed.managed_memory = false;
  Ready r({no_managed});
  CUdeviceptr m = 0;
  EXPECT_EQ(r.api().cuMemAllocManaged(&m, 1000, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(m, 0u);
  EXPECT_EQ(r.fake.outstanding().allocations, 0u);
}

TEST(FakeDriver, HostAllocationsMapToTheSameDeviceAddress) {
  Ready r;
  const DriverApi& api = r.api();
  void* host = nullptr;
  EXPECT_EQ(api.cuMemHostAlloc(&host, 1000, 0x8), CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(api.cuMemHostAlloc(&host, 1000, CU_MEMHOSTALLOC_DEVICEMAP), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().host_allocs, 1u);
  EXPECT_EQ(r.fake.outstanding().allocations, 0u);
  EXPECT_EQ(r.fake.device_bytes_in_use(), 0u);
  auto* bytes = static_cast<std::uint8_t*>(host);
  CUdeviceptr d = 0;
  EXPECT_EQ(api.cuMemHostGetDevicePointer(&d, host, 0), CUDA_SUCCESS);
  EXPECT_EQ(d, reinterpret_cast<std::uintptr_t>(host));
  EXPECT_EQ(api.cuMemHostGetDevicePointer(&d, bytes + 999, 0), CUDA_SUCCESS);  // interior
  EXPECT_EQ(d, reinterpret_cast<std::uintptr_t>(bytes + 999));
  EXPECT_EQ(api.cuMemHostGetDevicePointer(&d, bytes + 1000, 0), CUDA_ERROR_INVALID_VALUE);
  int unrelated = 0;
  EXPECT_EQ(api.cuMemHostGetDevicePointer(&d, &unrelated, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemHostGetDevicePointer(&d, host, 1), CUDA_ERROR_INVALID_VALUE);
  // The mapped pointer is usable as device memory, and the host sees the bytes.
  const CUdeviceptr dev = r.alloc(16);
  r.write(dev, {9, 8, 7, 6});
  const CUdeviceptr mapped = reinterpret_cast<std::uintptr_t>(bytes + 100);
  EXPECT_EQ(api.cuMemcpyDtoDAsync(mapped, dev, 4, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(Bytes(bytes + 100, bytes + 104), (Bytes{9, 8, 7, 6}));
  EXPECT_EQ(api.cuMemFree(reinterpret_cast<std::uintptr_t>(host)), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemFreeHost(reinterpret_cast<void*>(static_cast<std::uintptr_t>(dev))),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemFreeHost(host), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFreeHost(host), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemFree(dev), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().host_allocs, 0u);
}

TEST(FakeDriver, CopiesMoveBytesAndRefuseOutOfBoundsRanges) {
  Ready r;
  const DriverApi& api = r.api();
  const CUdeviceptr a = r.alloc(16), b = r.alloc(16);
  EXPECT_EQ(r.read(a, 2), (Bytes{0xA5, 0xA5}));  // new memory is not zeroed
  const Bytes data{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  r.write(a, data);
  EXPECT_EQ(api.cuMemcpyDtoDAsync(b + 4, a, 8, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(r.read(b + 4, 8), Bytes(data.begin(), data.begin() + 8));

  Bytes big(17, 0xEE);
  EXPECT_EQ(api.cuMemcpyHtoDAsync(a, big.data(), 17, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemcpyHtoDAsync(a + 1, big.data(), 16, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(r.read(a, 16), data);  // nothing written
  Bytes out(8, 0);
  EXPECT_EQ(api.cuMemcpyDtoHAsync(out.data(), a + 12, 8, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(out, Bytes(8, 0));
  EXPECT_EQ(api.cuMemcpyDtoDAsync(b + 9, a, 8, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemcpyDtoDAsync(b, a + 9, 8, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemcpyDtoHAsync(out.data(), 0x1000, 1, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemcpyHtoDAsync(a, nullptr, 0, nullptr), CUDA_SUCCESS);  // nothing to move
  EXPECT_EQ(api.cuMemFree(a), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemcpyDtoHAsync(out.data(), a, 1, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuMemFree(b), CUDA_SUCCESS);
}

TEST(FakeDriver, MemsetD8SetsExactlyTheRange) {
  Ready r;
  const CUdeviceptr p = r.alloc(8);
  r.write(p, Bytes(8, 0));
  EXPECT_EQ(r.api().cuMemsetD8Async(p + 2, 0x5C, 4, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(r.read(p, 8), (Bytes{0, 0, 0x5C, 0x5C, 0x5C, 0x5C, 0, 0}));
  EXPECT_EQ(r.api().cuMemsetD8Async(p + 2, 1, 7, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(r.read(p, 8), (Bytes{0, 0, 0x5C, 0x5C, 0x5C, 0x5C, 0, 0}));
}

CUDA_MEMCPY2D device_2d(CUdeviceptr dst, std::size_t dst_pitch, CUdeviceptr src,
                        std::size_t src_pitch, std::size_t width, std::size_t height) {
  CUDA_MEMCPY2D c{};
  c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  c.srcDevice = src;
  c.srcPitch = src_pitch;
  c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  c.dstDevice = dst;
  c.dstPitch = dst_pitch;
  c.WidthInBytes = width;
  c.Height = height;
  return c;
}

TEST(FakeDriver, Memcpy2DCopiesRowsBetweenPitches) {
  Ready r;
  const DriverApi& api = r.api();
  const CUdeviceptr src = r.alloc(4 * 16), dst = r.alloc(4 * 32);
  Bytes src_bytes(64);
  for (std::size_t i = 0; i < src_bytes.size(); ++i) src_bytes[i] = static_cast<std::uint8_t>(i);
  r.write(src, src_bytes);
  r.write(dst, Bytes(128, 0xFF));
  // Rows 1..3 of src from column 2, 10 bytes wide, into rows 0..2 of dst from column 4.
  CUDA_MEMCPY2D c = device_2d(dst, 32, src, 16, 10, 3);
  c.srcXInBytes = 2;
  c.srcY = 1;
  c.dstXInBytes = 4;
  EXPECT_EQ(api.cuMemcpy2DAsync(&c, nullptr), CUDA_SUCCESS);
  Bytes expected(128, 0xFF);
  for (std::size_t row = 0; row < 3; ++row) {
    for (std::size_t col = 0; col < 10; ++col) {
      expected[row * 32 + 4 + col] = src_bytes[(row + 1) * 16 + 2 + col];
    }
  }
  EXPECT_EQ(r.read(dst, 128), expected);

  c.srcY = 2;  // the last row would end 2 + 10 bytes into a fifth source row
  EXPECT_EQ(api.cuMemcpy2DAsync(&c, nullptr), CUDA_ERROR_INVALID_VALUE);
  CUDA_MEMCPY2D wide = device_2d(dst, 32, src, 8, 10, 2);  // width above the source pitch
  EXPECT_EQ(api.cuMemcpy2DAsync(&wide, nullptr), CUDA_ERROR_INVALID_VALUE);
  CUDA_MEMCPY2D array = device_2d(dst, 32, src, 16, 10, 2);
  array.srcMemoryType = CU_MEMORYTYPE_ARRAY;
  EXPECT_EQ(api.cuMemcpy2DAsync(&array, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(r.read(dst, 128), expected);
  EXPECT_EQ(api.cuMemFree(src), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(dst), CUDA_SUCCESS);
}

// ---- modules ----

TEST(FakeDriver, FakeImageIsPrefixedNameWithNul) {
  const auto image = FakeDriver::fake_image("core");
  const std::string text = "FAKEMOD:core";
  EXPECT_EQ(image, std::vector<unsigned char>(text.c_str(), text.c_str() + text.size() + 1));
}

TEST(FakeDriver, LoadsOnlyRegisteredImages) {
  Ready r;
  const DriverApi& api = r.api();
  r.fake.add_module("core", FakeModule{});
  CUmodule m = nullptr;
  const auto other = FakeDriver::fake_image("other");
  const unsigned char fatbin[] = {0x50, 0xED, 0x55, 0xBA, 0x01, 0x00, 0x10, 0x00};
  EXPECT_EQ(api.cuModuleLoadData(&m, other.data()), CUDA_ERROR_INVALID_IMAGE);
  EXPECT_EQ(api.cuModuleLoadData(&m, fatbin), CUDA_ERROR_INVALID_IMAGE);
  EXPECT_EQ(api.cuModuleLoadData(&m, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(m, nullptr);
  EXPECT_EQ(r.fake.outstanding().modules, 0u);
  const auto core = FakeDriver::fake_image("core");
  EXPECT_EQ(api.cuModuleLoadData(&m, core.data()), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().modules, 1u);
  EXPECT_EQ(api.cuModuleUnload(m), CUDA_SUCCESS);
  EXPECT_EQ(api.cuModuleUnload(m), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(r.fake.outstanding().modules, 0u);
}

TEST(FakeDriver, ModuleFunctionsAndGlobals) {
  Ready r;
  const DriverApi& api = r.api();
  FakeModule desc;
  desc.functions["fill_u32"];
  desc.publish_u32("fill_u32_n_tile", 0x01020304);
  desc.globals["locked"] = FakeGlobal{{std::byte{1}}, CUDA_ERROR_NOT_SUPPORTED};
  CUmodule m = nullptr;
  const CUfunction f = r.function(desc, "fill_u32", &m);
  CUfunction again = nullptr, missing = nullptr;
  EXPECT_EQ(api.cuModuleGetFunction(&again, m, "fill_u32"), CUDA_SUCCESS);
  EXPECT_EQ(again, f);
  EXPECT_EQ(api.cuModuleGetFunction(&missing, m, "fill_u64"), CUDA_ERROR_NOT_FOUND);

  CUdeviceptr g = 0;
  std::size_t size = 0;
  EXPECT_EQ(api.cuModuleGetGlobal(&g, &size, m, "fill_u32_n_tile"), CUDA_SUCCESS);
  EXPECT_EQ(size, 4u);
  EXPECT_EQ(r.read(g, 4), (Bytes{0x04, 0x03, 0x02, 0x01}));  // little-endian
  EXPECT_EQ(api.cuModuleGetGlobal(&g, &size, m, "nope"), CUDA_ERROR_NOT_FOUND);
  EXPECT_EQ(api.cuModuleGetGlobal(&g, &size, m, "locked"), CUDA_ERROR_NOT_SUPPORTED);

  // A second load has globals of its own.
  const auto image = FakeDriver::fake_image("m");
  CUmodule m2 = nullptr;
  CUdeviceptr g2 = 0;
  ASSERT_EQ(api.cuModuleLoadData(&m2, image.data()), CUDA_SUCCESS);
  EXPECT_EQ(api.cuModuleGetGlobal(&g2, nullptr, m2, "fill_u32_n_tile"), CUDA_SUCCESS);
  EXPECT_NE(g2, g);
  EXPECT_EQ(r.fake.outstanding().modules, 2u);

  EXPECT_EQ(api.cuModuleUnload(m), CUDA_SUCCESS);  // its functions and globals go with it
  EXPECT_EQ(r.launch(f, nullptr, nullptr), CUDA_ERROR_INVALID_HANDLE);
  Bytes out(4);
  EXPECT_EQ(api.cuMemcpyDtoHAsync(out.data(), g, 4, nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuModuleGetFunction(&again, m, "fill_u32"), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(r.read(g2, 4), (Bytes{0x04, 0x03, 0x02, 0x01}));
  EXPECT_EQ(api.cuModuleUnload(m2), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.outstanding().allocations, 0u);  // globals are not allocations
}

// ---- launches ----

TEST(FakeDriver, LaunchRecordsAndRunsTheBody) {
  Ready r;
  const DriverApi& api = r.api();
  std::vector<FakeLaunch> seen;
  int runs = 0;
  FakeModule desc = filler(&runs);
  desc.functions["k"].body = [&seen, fill = desc.functions["k"].body](const FakeLaunch& l) {
    seen.push_back(l);
    fill(l);
  };
  desc.functions["quiet"];  // no body: recorded only
  CUmodule m = nullptr;
  const CUfunction k = r.function(desc, "k", &m);
  CUfunction quiet = nullptr;
  ASSERT_EQ(api.cuModuleGetFunction(&quiet, m, "quiet"), CUDA_SUCCESS);
  const CUstream s = r.stream();
  CUdeviceptr p = r.alloc(64);
  r.write(p, Bytes(64, 0));
  std::uint32_t n = 40;
  void* params[] = {&p, &n};
  EXPECT_EQ(api.cuLaunchKernel(k, 2, 3, 4, 32, 2, 1, 128, s, params, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(api.cuLaunchKernel(quiet, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, nullptr),
            CUDA_SUCCESS);
  EXPECT_EQ(runs, 1);  // once per launch, not per block
  Bytes expected(64, 0);
  std::fill(expected.begin(), expected.begin() + 40, 0x7F);
  EXPECT_EQ(r.read(p, 64), expected);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].params, params);

  const auto launches = r.fake.launches();
  ASSERT_EQ(launches.size(), 2u);
  EXPECT_EQ(launches[0].function, "k");
  EXPECT_THAT(launches[0].grid, ::testing::ElementsAre(2u, 3u, 4u));
  EXPECT_THAT(launches[0].block, ::testing::ElementsAre(32u, 2u, 1u));
  EXPECT_EQ(launches[0].shared_bytes, 128u);
  EXPECT_EQ(launches[0].stream, s);
  EXPECT_EQ(launches[0].params, nullptr);  // valid only while a body runs
  EXPECT_EQ(launches[1].function, "quiet");
  EXPECT_EQ(launches[1].stream, nullptr);
}

TEST(FakeDriver, BodyRunsWithoutTheLockHeld) {
  Ready r;
  const DriverApi& api = r.api();
  const CUdeviceptr p = r.alloc(4);
  FakeModule desc;
  CUresult inner = CUDA_ERROR_UNKNOWN;
  desc.functions["k"].body = [&](const FakeLaunch&) {
    inner = api.cuMemsetD8Async(p, 0x11, 4, nullptr);  // would deadlock under the lock
  };
  const CUfunction k = r.function(desc, "k");
  EXPECT_EQ(r.launch(k, nullptr, nullptr), CUDA_SUCCESS);
  EXPECT_EQ(inner, CUDA_SUCCESS);
  EXPECT_EQ(r.read(p, 4), Bytes(4, 0x11));
}

TEST(FakeDriver, DynamicSharedMemoryAbove48KiBNeedsTheAttribute) {
  Ready r;
  const DriverApi& api = r.api();
  FakeModule desc;
  desc.functions["k"];
  const CUfunction k = r.function(desc, "k");
  EXPECT_EQ(r.launch(k, nullptr, nullptr, 48 * 1024), CUDA_SUCCESS);
  EXPECT_EQ(r.launch(k, nullptr, nullptr, 48 * 1024 + 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(r.fake.max_dynamic_shared("k"), 0);
  const auto attr = CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
  EXPECT_EQ(api.cuFuncSetAttribute(k, attr, 100000), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.max_dynamic_shared("k"), 100000);
  EXPECT_EQ(r.launch(k, nullptr, nullptr, 100000), CUDA_SUCCESS);
  EXPECT_EQ(r.launch(k, nullptr, nullptr, 100001), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(api.cuFuncSetAttribute(k, attr, 232449), CUDA_ERROR_INVALID_VALUE);  // above opt-in
  EXPECT_EQ(r.fake.max_dynamic_shared("k"), 100000);
  EXPECT_EQ(api.cuFuncSetAttribute(k, attr, 232448), CUDA_SUCCESS);
  EXPECT_EQ(r.launch(k, nullptr, nullptr, 232448), CUDA_SUCCESS);
  EXPECT_EQ(api.cuFuncSetAttribute(nullptr, attr, 1), CUDA_ERROR_INVALID_HANDLE);
  EXPECT_EQ(r.fake.launches().size(), 3u);  // refused launches are not recorded
}

TEST(FakeDriver, LaunchShapeLimitsAreTheDrivers) {
  Ready r;
  const DriverApi& api = r.api();
  FakeModule desc;
  desc.functions["k"];
  const CUfunction k = r.function(desc, "k");
  auto launch = [&](unsigned gx, unsigned gy, unsigned bx, unsigned by, unsigned bz) {
    return api.cuLaunchKernel(k, gx, gy, 1, bx, by, bz, 0, nullptr, nullptr, nullptr);
  };
  EXPECT_EQ(launch(2147483647u, 65535, 1024, 1, 1), CUDA_SUCCESS);
  EXPECT_EQ(launch(1, 1, 1025, 1, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(launch(1, 1, 32, 32, 2), CUDA_ERROR_INVALID_VALUE);  // 2048 threads
  EXPECT_EQ(launch(1, 1, 1, 1, 65), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(launch(0, 1, 32, 1, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(launch(1, 65536, 32, 1, 1), CUDA_ERROR_INVALID_VALUE);
  void* extra[] = {nullptr};
  EXPECT_EQ(api.cuLaunchKernel(k, 1, 1, 1, 1, 1, 1, 0, nullptr, nullptr, extra),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(r.fake.launches().size(), 1u);
}

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

// ---- failure injection and observation ----

TEST(FakeDriver, FailAtFailsOnlyTheNthCallAndDoesNothingElse) {
  Ready r;
  const DriverApi& api = r.api();
  r.fake.fail_at("cuMemAlloc", 2, CUDA_ERROR_OUT_OF_MEMORY);
  const CUdeviceptr a = r.alloc(16);
  CUdeviceptr p = 0;
  EXPECT_EQ(api.cuMemAlloc(&p, 16), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(p, 0u);
  EXPECT_EQ(r.fake.outstanding().allocations, 1u);
  const CUdeviceptr b = r.alloc(16);
  EXPECT_EQ(r.fake.calls("cuMemAlloc"), 3u);
  EXPECT_EQ(r.fake.calls("cuMemFree"), 0u);
  EXPECT_EQ(api.cuMemFree(a), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(b), CUDA_SUCCESS);
}

TEST(FakeDriver, FailFromFailsEveryLaterCallUntilCleared) {
  Ready r;
  const DriverApi& api = r.api();
  r.fake.fail_from("cuStreamCreate", 2, CUDA_ERROR_LAUNCH_FAILED);
  CUstream s = nullptr;
  EXPECT_EQ(api.cuStreamCreate(&s, 0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(api.cuStreamCreate(&s, 0), CUDA_ERROR_LAUNCH_FAILED);
  EXPECT_EQ(r.fake.outstanding().streams, 0u);
  r.fake.clear_failures();
  EXPECT_EQ(api.cuStreamCreate(&s, 0), CUDA_SUCCESS);
  EXPECT_EQ(r.fake.calls("cuStreamCreate"), 5u);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
}

TEST(FakeDriver, InjectedFailuresComeFirstAndCuInitCanFail) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  fake.fail_at("cuInit", 1, CUDA_ERROR_NO_DEVICE);
  fake.fail_at("cuDeviceGetCount", 1, CUDA_ERROR_UNKNOWN);
  int count = -1;
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_ERROR_UNKNOWN);  // before the init rule
  EXPECT_EQ(api.cuInit(0), CUDA_ERROR_NO_DEVICE);
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(api.cuInit(0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDeviceGetCount(&count), CUDA_SUCCESS);
}

TEST(FakeDriver, CountsEveryCallIncludingFailedOnes) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  int v = 0;
  EXPECT_EQ(fake.total_calls(), 0u);
  EXPECT_EQ(api.cuDeviceGetCount(&v), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(api.cuInit(0), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDriverGetVersion(&v), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDriverGetVersion(nullptr), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(fake.calls("cuDeviceGetCount"), 1u);
  EXPECT_EQ(fake.calls("cuInit"), 1u);
  EXPECT_EQ(fake.calls("cuDriverGetVersion"), 2u);
  EXPECT_EQ(fake.total_calls(), 4u);
  // Only the table's names: a versioned symbol or a typo would never match a call.
  EXPECT_THROW(fake.calls("cuMemAlloc_v2"), std::invalid_argument);
  EXPECT_THROW(fake.fail_at("cuMemalloc", 1, CUDA_ERROR_UNKNOWN), std::invalid_argument);
  EXPECT_THROW(fake.fail_from("cuLaunch", 1, CUDA_ERROR_UNKNOWN), std::invalid_argument);
  EXPECT_EQ(fake.calls("cuLaunchKernel"), 0u);
}

TEST(FakeDriver, StickyFaultFailsSynchronizationLaunchesAndCopies) {
  Ready r;
  const DriverApi& api = r.api();
  FakeModule desc;
  desc.functions["k"];
  const CUfunction k = r.function(desc, "k");
  const CUstream s = r.stream();
  const CUdeviceptr p = r.alloc(8);
  r.write(p, Bytes(8, 0));
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  ASSERT_EQ(api.cuGraphInstantiateWithFlags(&exec, graph, 0), CUDA_SUCCESS);

  const CUresult fault = CUDA_ERROR_ILLEGAL_ADDRESS;
  r.fake.set_sticky_fault(fault);
  Bytes host(8, 1);
  CUDA_MEMCPY2D c = device_2d(p, 8, p, 8, 4, 1);
  EXPECT_EQ(api.cuCtxSynchronize(), fault);
  EXPECT_EQ(api.cuStreamSynchronize(s), fault);
  EXPECT_EQ(r.launch(k, s, nullptr), fault);
  EXPECT_EQ(api.cuMemcpyHtoDAsync(p, host.data(), 8, s), fault);
  EXPECT_EQ(api.cuMemcpyDtoHAsync(host.data(), p, 8, s), fault);
  EXPECT_EQ(api.cuMemcpyDtoDAsync(p, p, 8, s), fault);
  EXPECT_EQ(api.cuMemcpy2DAsync(&c, s), fault);
  EXPECT_EQ(api.cuMemsetD8Async(p, 1, 8, s), fault);
  EXPECT_EQ(api.cuGraphLaunch(exec, s), fault);
  EXPECT_EQ(host, Bytes(8, 1));
  EXPECT_TRUE(r.fake.launches().empty());
  EXPECT_EQ(r.fake.graph_replays(), 0u);
  CUdeviceptr q = 0;
  EXPECT_EQ(api.cuMemAlloc(&q, 8), CUDA_SUCCESS);  // not every call
  EXPECT_EQ(api.cuMemFree(q), CUDA_SUCCESS);
}

TEST(FakeDriver, OutstandingCountsEachKindUntilReleased) {
  FakeDriver fake;
  const DriverApi& api = fake.api();
  EXPECT_TRUE(fake.outstanding().none());
  ASSERT_EQ(api.cuInit(0), CUDA_SUCCESS);
  CUcontext ctx = nullptr;
  ASSERT_EQ(api.cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
  ASSERT_EQ(api.cuCtxSetCurrent(ctx), CUDA_SUCCESS);
  CUdeviceptr dev = 0, managed = 0;
  void* host = nullptr;
  CUstream s = nullptr;
  CUevent e = nullptr;
  CUmodule m = nullptr;
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  fake.add_module("m", FakeModule{});
  const auto image = FakeDriver::fake_image("m");
  ASSERT_EQ(api.cuMemAlloc(&dev, 8), CUDA_SUCCESS);
  ASSERT_EQ(api.cuMemAllocManaged(&managed, 8, CU_MEM_ATTACH_GLOBAL), CUDA_SUCCESS);
  ASSERT_EQ(api.cuMemHostAlloc(&host, 8, 0), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  ASSERT_EQ(api.cuEventCreate(&e, 0), CUDA_SUCCESS);
  ASSERT_EQ(api.cuModuleLoadData(&m, image.data()), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED), CUDA_SUCCESS);
  ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  ASSERT_EQ(api.cuGraphInstantiateWithFlags(&exec, graph, 0), CUDA_SUCCESS);

  const FakeOutstanding out = fake.outstanding();
  EXPECT_EQ(out.allocations, 2u);
  EXPECT_EQ(out.host_allocs, 1u);
  EXPECT_EQ(out.modules, 1u);
  EXPECT_EQ(out.streams, 1u);
  EXPECT_EQ(out.events, 1u);
  EXPECT_EQ(out.graphs, 1u);
  EXPECT_EQ(out.graph_execs, 1u);
  EXPECT_EQ(out.contexts, 1u);
  EXPECT_FALSE(out.none());

  EXPECT_EQ(api.cuGraphExecDestroy(exec), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_SUCCESS);
  EXPECT_EQ(api.cuModuleUnload(m), CUDA_SUCCESS);
  EXPECT_EQ(api.cuEventDestroy(e), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFreeHost(host), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(managed), CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree(dev), CUDA_SUCCESS);
  EXPECT_FALSE(fake.outstanding().none());  // the context is still retained
  EXPECT_EQ(api.cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
  EXPECT_TRUE(fake.outstanding().none());
}

// Each single field keeps none() false.
TEST(FakeDriver, NoneIsFalseForAnySingleLeftover) {
  std::size_t FakeOutstanding::*fields[] = {
      &FakeOutstanding::allocations, &FakeOutstanding::host_allocs, &FakeOutstanding::modules,
      &FakeOutstanding::streams,     &FakeOutstanding::events,      &FakeOutstanding::graphs,
      &FakeOutstanding::graph_execs, &FakeOutstanding::contexts};
  for (auto field : fields) {
    FakeOutstanding out;
    EXPECT_TRUE(out.none());
    out.*field = 1;
    EXPECT_FALSE(out.none());
  }
}

}  // namespace
}  // namespace metrale::cuda::testing
