// The host emulation of CUDA itself (cuda_host.h, kernel_host_ptx.h), before any kernel trusts
// it: __syncthreads orders a block's shared-memory writes before its reads, blocks see their
// own index, a barrier that not every thread reaches is reported as a deadlock rather than a
// hang, loads outside the declared buffers or misaligned are reported, and the warp MMA equals
// a direct matrix product when the fragments are laid out by tile_math.h's m16n8k16 helpers.
#include "cuda_host.h"  // first: the CUDA language on the host

#include "cuda/kernels/ptx.cuh"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/tile_math.h"
#include "metrale/numerics.h"

namespace metrale::emulation {
namespace {

TEST(CudaHost, SyncthreadsOrdersSharedMemoryAndBlocksSeeTheirIndex) {
  std::vector<int> wrong(1, 0);
  std::vector<unsigned> seen;
  const std::string error = run_grid(dim3(3, 1, 2), 256, {}, [&] {
    __shared__ unsigned box[256];
    box[threadIdx.x] = threadIdx.x + 1000 * blockIdx.x + 10000 * blockIdx.z;
    __syncthreads();
    const unsigned other = (threadIdx.x + 1) % 256;
    if (box[other] != other + 1000 * blockIdx.x + 10000 * blockIdx.z) ++wrong[0];
    __syncthreads();  // box is rewritten by the next block only after every read
    if (threadIdx.x == 0) seen.push_back(blockIdx.x + 10 * blockIdx.z);
  });
  EXPECT_EQ(error, "");
  EXPECT_EQ(wrong[0], 0);
  EXPECT_EQ(seen, (std::vector<unsigned>{0, 1, 2, 10, 11, 12}));
}

TEST(CudaHost, ABarrierThatAThreadSkipsIsADeadlock) {
  const std::string error = run_grid(dim3(1), 64, {}, [] {
    if (threadIdx.x == 5) return;
    __syncthreads();
  });
  EXPECT_NE(error.find("deadlock"), std::string::npos) << error;
  // The runtime is usable again afterwards.
  EXPECT_EQ(run_grid(dim3(1), 64, {}, [] { __syncthreads(); }), "");
}

TEST(CudaHost, LoadsOutsideTheBuffersOrMisalignedAreFaults) {
  alignas(16) static std::uint8_t buf[128] = {};
  // The first 64 bytes are the buffer; offsets at run time, so the compiler sees no bound.
  const std::vector<Region> readable = {{buf, 64}};
  volatile int last = 48, past_end = 64, odd_at = 4;
  EXPECT_EQ(run_grid(dim3(1), 32, readable, [&] { (void)ptx::ldg16(buf + last); }), "");
  const std::string past =
      run_grid(dim3(1), 32, readable, [&] { (void)ptx::ldg16(buf + past_end); });
  EXPECT_NE(past.find("outside every readable buffer"), std::string::npos) << past;
  const std::string odd = run_grid(dim3(1), 32, readable, [&] { (void)ptx::ldg8(buf + odd_at); });
  EXPECT_NE(odd.find("misaligned"), std::string::npos) << odd;
}

// A 16x16 BF16, B 16x8 BF16, D = A B + C in FP32, through one warp's fragments.
TEST(CudaHost, WarpMmaIsTheMatrixProductOfItsFragments) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::uint16_t a[16][16], b[16][8];
  float c[16][8], got[16][8];
  for (auto& row : a) {
    for (auto& x : row) x = num::f32_to_bf16(u(rng));
  }
  for (auto& row : b) {
    for (auto& x : row) x = num::f32_to_bf16(u(rng));
  }
  for (auto& row : c) {
    for (auto& x : row) x = u(rng);
  }
  const std::string error = run_grid(dim3(1), 32, {}, [&] {
    const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
    // Element j of a k quad is MMA k decode_logical_k(t, j): the first register pair holds
    // k 2t, 2t + 1 of rows g and g + 8, the second pair k 2t + 8, 2t + 9.
    const auto pair = [](std::uint16_t lo, std::uint16_t hi) {
      return std::uint32_t{lo} | std::uint32_t{hi} << 16;
    };
    const int k0 = tiles::decode_logical_k(t, 0), k2 = tiles::decode_logical_k(t, 2);
    const std::uint32_t fa[4] = {pair(a[g][k0], a[g][k0 + 1]), pair(a[g + 8][k0], a[g + 8][k0 + 1]),
                                 pair(a[g][k2], a[g][k2 + 1]),
                                 pair(a[g + 8][k2], a[g + 8][k2 + 1])};
    const std::uint32_t b0 = pair(b[k0][g], b[k0 + 1][g]), b1 = pair(b[k2][g], b[k2 + 1][g]);
    float d[4];
    for (int i = 0; i < 4; ++i) d[i] = c[tiles::mma_acc_row(lane, i)][tiles::mma_acc_col(lane, i)];
    ptx::mma_bf16_16816(d, fa, b0, b1);
    for (int i = 0; i < 4; ++i)
      got[tiles::mma_acc_row(lane, i)][tiles::mma_acc_col(lane, i)] = d[i];
  });
  ASSERT_EQ(error, "");
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      double want = c[r][n];
      for (int k = 0; k < 16; ++k) {
        want += double{num::bf16_to_f32(a[r][k])} * double{num::bf16_to_f32(b[k][n])};
      }
      EXPECT_NEAR(got[r][n], want, 1e-5 * 64) << "D[" << r << ", " << n << "]";
    }
  }
}

}  // namespace
}  // namespace metrale::emulation
