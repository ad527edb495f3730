// The fake CUDA driver's modules, functions, globals and launches.
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
using fake_test::filler;
using fake_test::kMiB;
using fake_test::Ready;

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

}  // namespace
}  // namespace metrale::cuda::testing
