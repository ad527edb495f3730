// Shared by the fake driver's own tests (fake_*_test.cpp): a fake ready for work, and a module
// whose kernel body fills memory.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/fake_driver.h"

namespace metrale::cuda::testing::fake_test {

using Bytes = std::vector<std::uint8_t>;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;

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
inline FakeModule filler(int* runs, bool declare_sizes = false) {
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

// A device-to-device 2D copy of `height` rows of `width` bytes.
inline CUDA_MEMCPY2D device_2d(CUdeviceptr dst, std::size_t dst_pitch, CUdeviceptr src,
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

}  // namespace metrale::cuda::testing::fake_test
