// The fake CUDA driver's fault scripting (fail_at, fail_from, sticky faults) and observation.
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
