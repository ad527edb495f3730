// The fake CUDA driver's memory: allocations, host memory, copies and memsets.
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

}  // namespace
}  // namespace metrale::cuda::testing
