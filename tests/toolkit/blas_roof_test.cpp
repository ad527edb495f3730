// The CUDA compute roof (tools/toolkit, toolkit/blas_roof.h) where it cannot be measured: it
// answers with a reason instead of throwing, before it loads cuBLASLt or allocates anything. (The
// measured path needs a GPU: scripts/device-check.sh reaches it through `metrale bench --backend
// cuda`.)
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <tuple>

#include "metrale/cpu_backend.h"
#include "toolkit/blas_roof.h"

namespace metrale::toolkit {
namespace {

using ::testing::HasSubstr;

TEST(BlasRoof, ANonCudaBackendGetsAReasonAndNothingIsAllocated) {
  CpuBackend backend(CpuBackendOptions{.threads = 1});
  const Bf16Rate r = measure_bf16_gemm_rate(backend, 64);
  EXPECT_EQ(r.flops, 0.0);
  EXPECT_EQ(r.what, "not measured: the cpu backend is not a CUDA device");
  EXPECT_EQ(backend.alloc_stats().allocation_count, 0u);
  EXPECT_EQ(backend.live_bytes(), 0u);
  EXPECT_EQ(backend.live_alloc_count(), 0u);
}

TEST(BlasRoof, ASizeThatIsNoMultipleOf16IsRefusedBeforeAnythingIsLoaded) {
  CpuBackend backend(CpuBackendOptions{.threads = 1});
  for (const int n : {0, -16, 10}) {
    const Bf16Rate r = measure_bf16_gemm_rate(backend, n);
    EXPECT_EQ(r.flops, 0.0);
    EXPECT_THAT(r.what, HasSubstr("is not made of positive multiples of 16")) << n;
  }
  // The w4a16 shape form: every dimension is checked, M included.
  for (const auto& [m, n, k] :
       {std::tuple{1, 4096, 4096}, std::tuple{16, 4096, 4104}, std::tuple{4096, 0, 4096}}) {
    const Bf16Rate r = measure_bf16_gemm(backend, m, n, k);
    EXPECT_EQ(r.flops, 0.0);
    EXPECT_EQ(r.seconds, 0.0);
    EXPECT_THAT(r.what, HasSubstr(fmt::format("{}x{}x{} is not made of positive multiples of 16", m,
                                              n, k)));
  }
  EXPECT_EQ(backend.live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale::toolkit
