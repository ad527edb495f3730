// The fake CUDA driver on its own: it must answer like the driver, since every CUDA backend
// test trusts it. Each test drives the table exactly as backend code would.
// This file: construction, initialisation, devices and contexts; the other fake_*_test.cpp
// files take memory, modules and launches, streams and graphs, and fault scripting.
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
#include "cuda/status.h"

namespace metrale::cuda::testing {
namespace {

using fake_test::Bytes;
using fake_test::filler;
using fake_test::kMiB;
using fake_test::Ready;

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

}  // namespace
}  // namespace metrale::cuda::testing
