// The FP8 weight upload (src/ops/fp8_weights.cpp) when device memory is full, on the fake
// driver: both buffers go to managed memory through alloc_weights' fallback, hold the codes and
// the repacked scales, are on the ledger, and free back to nothing; when the fallback fails too,
// nothing is left behind.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/fp8_gemm.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;

constexpr std::int64_t kN = 200, kK = 300;  // scales [2, 3], device rows 4 apart

struct HostFp8 {
  std::vector<std::uint8_t> codes, scales;
};

HostFp8 random_host(std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(0.01f, 2.0f);
  HostFp8 h;
  h.codes.resize(static_cast<std::size_t>(kN * kK));
  for (auto& c : h.codes) c = static_cast<std::uint8_t>(gen() & 0x7E);  // no NaN codes
  std::vector<float> s(2 * 3);
  for (auto& v : s) v = u(gen);
  h.scales.resize(s.size() * 4);
  std::memcpy(h.scales.data(), s.data(), h.scales.size());
  return h;
}

TEST(Fp8UploadFallback, FullDeviceMemoryPutsBothBuffersInManagedMemory) {
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  const HostFp8 h = random_host(seed);
  Rig rig;
  CudaBackend& b = rig.b();
  const std::size_t live = b.live_alloc_count();
  const std::size_t allocs = rig.fd.outstanding().allocations;
  rig.fd.fail_from("cuMemAlloc", rig.fd.calls("cuMemAlloc") + 1, CUDA_ERROR_OUT_OF_MEMORY);
  ops::Fp8Weights w = ops::upload_fp8_weights(b, h.codes, h.scales, kN, kK);
  EXPECT_TRUE(b.op_cache().alloc_fell_back());
  EXPECT_EQ(rig.fd.calls("cuMemAllocManaged"), 2u);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 0u);
  EXPECT_EQ(b.live_alloc_count(), live + 2);
  // The bytes landed: the codes as given, the scales at their device rows (ld 4).
  ASSERT_TRUE(w.codes && w.scales);
  EXPECT_EQ(std::memcmp(host_view<std::uint8_t>(w.codes), h.codes.data(), h.codes.size()), 0);
  const float* ds = host_view<const float>(w.scales);
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 3; ++c) {
      float want = 0;
      std::memcpy(&want, h.scales.data() + (r * 3 + c) * 4, 4);
      EXPECT_EQ(ds[r * 4 + c], want) << r << "," << c;
    }
  }
  ops::free_fp8_weights(b, w);
  EXPECT_EQ(b.live_alloc_count(), live);
  EXPECT_EQ(rig.fd.outstanding().allocations, allocs);
  rig.fd.clear_failures();
}

TEST(Fp8UploadFallback, AFailedFallbackLeavesNothingBehind) {
  const HostFp8 h = random_host(std::random_device{}());
  Rig rig;
  CudaBackend& b = rig.b();
  const std::size_t live = b.live_alloc_count();
  const std::size_t allocs = rig.fd.outstanding().allocations;
  // The codes fit in device memory; the scales find it full and managed memory refused too.
  rig.fd.fail_from("cuMemAlloc", rig.fd.calls("cuMemAlloc") + 2, CUDA_ERROR_OUT_OF_MEMORY);
  rig.fd.fail_from("cuMemAllocManaged", rig.fd.calls("cuMemAllocManaged") + 1,
                   CUDA_ERROR_OUT_OF_MEMORY);
  const Error e = expect_error([&] { ops::upload_fp8_weights(b, h.codes, h.scales, kN, kK); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_EQ(b.live_alloc_count(), live);
  EXPECT_EQ(rig.fd.device_bytes_in_use(), 0u);
  EXPECT_EQ(rig.fd.outstanding().allocations, allocs);
  rig.fd.clear_failures();
}

}  // namespace
}  // namespace metrale::cuda::testing
