// The same ops code (src/ops/elementwise.cpp) on the CUDA backend over the fake driver, whose
// core kernels have host bodies that cover exactly the grid they are launched with: results on
// fresh random data, nothing written past n, and the grid sized from the published tile.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using ::testing::HasSubstr;

constexpr std::uint32_t kPoison = 0xABABABABu;
constexpr std::size_t kTail = 37;  // elements past n that no op may touch

std::uint64_t fresh_seed() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) | rd();
}

std::uint32_t blocks_for(std::size_t n, std::uint32_t tile) {
  return static_cast<std::uint32_t>((n + tile - 1) / tile);
}

TEST(CudaOps, FillU32WritesEveryElementAndNothingPastN) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  for (std::size_t n : {std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{257},
                        std::size_t{1000}, std::size_t{65537}}) {
    SCOPED_TRACE(n);
    const DevicePtr out = b.alloc((n + kTail) * 4);
    b.memset(out, 0xAB, (n + kTail) * 4);
    const auto value = static_cast<std::uint32_t>(gen());
    ops::fill_u32(b, s, out, n, value);
    b.synchronize(s);
    std::vector<std::uint32_t> got(n + kTail);
    b.copy_d2h(got.data(), out, got.size() * 4);
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], value) << i;
    for (std::size_t i = n; i < n + kTail; ++i) ASSERT_EQ(got[i], kPoison) << i;
    const FakeLaunch last = rig.fd.launches().back();
    EXPECT_EQ(last.function, "fill_u32");
    EXPECT_EQ(last.grid[0], blocks_for(n, 256));
    EXPECT_EQ(last.block[0], 256u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(last.stream), s.value());
    b.free(out);
  }
  b.destroy_stream(s);
}

TEST(CudaOps, AxpyF32MatchesTheHostOnRandomData) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> dist(-10.0f, 10.0f);
  Rig rig;
  CudaBackend& b = rig.b();
  for (std::size_t n : {std::size_t{1}, std::size_t{300}, std::size_t{4099}}) {
    SCOPED_TRACE(n);
    std::vector<float> x(n), y(n);
    for (float& v : x) v = dist(gen);
    for (float& v : y) v = dist(gen);
    const float a = dist(gen);
    const DevicePtr dx = b.alloc(n * 4);
    const DevicePtr dy = b.alloc((n + kTail) * 4);
    b.memset(dy, 0xAB, (n + kTail) * 4);
    b.copy_h2d(dx, x.data(), n * 4);
    b.copy_h2d(dy, y.data(), n * 4);
    ops::axpy_f32(b, b.default_stream(), dy, dx, a, n);
    std::vector<float> got(n + kTail);
    b.copy_d2h(got.data(), dy, got.size() * 4);
    for (std::size_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(got[i], a * x[i] + y[i]) << i;
    std::vector<std::uint32_t> tail(kTail);
    b.copy_d2h(tail.data(), dy.offset(n * 4), kTail * 4);
    EXPECT_EQ(std::count(tail.begin(), tail.end(), kPoison), static_cast<long>(kTail));
    EXPECT_EQ(rig.fd.launches().back().grid[0], blocks_for(n, 256));
    b.free(dx);
    b.free(dy);
  }
}

// The original bug: a grid sized for a 128-wide tile on a 64-wide kernel writes about half the
// columns. Here the module publishes 64 and the kernel covers 64 per block, so only a grid
// sized from the published tile writes everything.
TEST(CudaOps, TheGridComesFromThePublishedTile) {
  Rig rig({.modules = {core_module(64)}});
  CudaBackend& b = rig.b();
  constexpr std::size_t kN = 1000;
  const DevicePtr out = b.alloc(kN * 4);
  b.memset(out, 0xAB, kN * 4);
  ops::fill_u32(b, b.default_stream(), out, kN, 7u);
  b.synchronize(b.default_stream());
  const auto launches = rig.fd.launches();
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].grid[0], 16u);  // ceil(1000 / 64)
  for (std::size_t i = 0; i < kN; ++i) ASSERT_EQ(host_view<std::uint32_t>(out)[i], 7u) << i;
  b.free(out);
}

// The kernels stride their tile by the block size they are written for: here 128 threads over
// a 512-element tile, four elements each. A launch of the 256 threads elementwise once assumed
// adds a * x twice to half the tile; only a block read from the published size matches the
// float64 reference.
TEST(CudaOps, TheBlockComesFromThePublishedBlockSize) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Rig rig({.modules = {core_module(512, 128)}});
  CudaBackend& b = rig.b();
  constexpr std::size_t kN = 1500;
  std::vector<float> x(kN), y(kN);
  for (auto& v : x) v = dist(gen);
  for (auto& v : y) v = dist(gen);
  const float a = dist(gen);
  const DevicePtr dx = b.alloc(kN * 4), dy = b.alloc(kN * 4);
  b.copy_h2d(dx, x.data(), kN * 4);
  b.copy_h2d(dy, y.data(), kN * 4);
  ops::axpy_f32(b, b.default_stream(), dy, dx, a, kN);
  b.synchronize(b.default_stream());
  std::vector<float> got(kN);
  b.copy_d2h(got.data(), dy, kN * 4);
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < kN; ++i) {
    const double want = double{a} * x[i] + y[i];
    err += (got[i] - want) * (got[i] - want);
    norm += want * want;
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-6);
  const FakeLaunch last = rig.fd.launches().back();
  EXPECT_EQ(last.block[0], 128u);
  EXPECT_EQ(last.grid[0], blocks_for(kN, 512));
  b.free(dx);
  b.free(dy);
}

TEST(CudaOps, AKernelPublishingNoBlockSizeLaunchesNothing) {
  ModuleSpec m = core_module();
  m.fake.globals.erase("fill_u32_block_threads");
  Rig rig({.modules = {m}});
  CudaBackend& b = rig.b();
  const DevicePtr out = b.alloc(64);
  const Error e = expect_error([&] { ops::fill_u32(b, b.default_stream(), out, 16, 1u); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("core::fill_u32 publishes no block size"));
  EXPECT_TRUE(rig.fd.launches().empty());
  b.free(out);
}

TEST(CudaOps, AKernelPublishingNoTileLaunchesNothing) {
  ModuleSpec m = core_module();
  m.fake.globals.erase("fill_u32_n_tile");
  Rig rig({.modules = {m}});
  CudaBackend& b = rig.b();
  const DevicePtr out = b.alloc(64);
  const Error e = expect_error([&] { ops::fill_u32(b, b.default_stream(), out, 16, 1u); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("core::fill_u32 publishes no N tile"));
  EXPECT_TRUE(rig.fd.launches().empty());
  b.free(out);
}

TEST(CudaOps, BadArgumentsLaunchNothingAndLookNothingUp) {
  Rig rig;
  CudaBackend& b = rig.b();
  const DevicePtr out = b.alloc(64);
  EXPECT_EQ(expect_error([&] { ops::fill_u32(b, StreamHandle{}, out.offset(2), 4, 1u); }).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { ops::fill_u32(b, StreamHandle{}, out, 0, 1u); }).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(
      expect_error([&] { ops::axpy_f32(b, StreamHandle{}, out, out.offset(4), 1.0f, 4); }).code(),
      ErrorCode::kInvalidArgument);
  EXPECT_TRUE(rig.fd.launches().empty());
  EXPECT_EQ(b.op_cache().kernel_count(), 0u);
  b.free(out);
}

// A range that starts inside one of the backend's allocations must end inside it (on a GPU the
// overrun would be an illegal address, a fault that kills the context); the ledger says so
// before anything is looked up or launched. Memory the backend did not allocate (another
// allocator's) cannot be judged from the ledger and is left to the driver.
TEST(CudaOps, ARangeOverrunningAnAllocationLaunchesNothing) {
  Rig rig;
  CudaBackend& b = rig.b();
  const DevicePtr out = b.alloc(64);  // 16 elements
  const Error e = expect_error([&] { ops::fill_u32(b, StreamHandle{}, out, 17, 1u); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[fill_u32] out"));
  EXPECT_THAT(e.what(), HasSubstr("+ 68 bytes overruns the allocation"));
  EXPECT_THAT(e.what(), HasSubstr("by 4 bytes"));
  const Error interior =
      expect_error([&] { ops::fill_u32(b, StreamHandle{}, out.offset(48), 5, 1u); });
  EXPECT_THAT(interior.what(), HasSubstr("by 4 bytes"));
  EXPECT_TRUE(rig.fd.launches().empty());
  EXPECT_EQ(b.op_cache().kernel_count(), 0u);

  // Exactly the allocation is fine, and so is memory the backend never saw.
  ops::fill_u32(b, StreamHandle{}, out, 16, 7u);
  CUdeviceptr foreign = 0;
  ASSERT_EQ(rig.table.cuMemAlloc(&foreign, 256), CUDA_SUCCESS);
  ops::fill_u32(b, StreamHandle{}, DevicePtr{foreign}, 64, 7u);
  b.synchronize(StreamHandle{});
  EXPECT_EQ(rig.fd.launches().size(), 2u);
  EXPECT_EQ(host_view<std::uint32_t>(DevicePtr{foreign})[63], 7u);
  EXPECT_EQ(rig.table.cuMemFree(foreign), CUDA_SUCCESS);
  b.free(out);
}

TEST(CudaOps, AnOpCapturedIntoAGraphReplaysWithItsOwnArguments) {
  Rig rig;
  CudaBackend& b = rig.b();
  b.require_kernels();  // resolves fill_u32 and axpy_f32 before any capture
  constexpr std::size_t kN = 777;
  const DevicePtr out = b.alloc(kN * 4);
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  ops::fill_u32(b, s, out, kN, 0x12345678u);  // its packed arguments die with this call
  const GraphHandle g = b.end_capture(s);
  b.memset(out, 0xAB, kN * 4);
  b.launch_graph(g, s);
  b.synchronize(s);
  for (std::size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(host_view<std::uint32_t>(out)[i], 0x12345678u) << i;
  }
  b.destroy_graph(g);
  b.destroy_stream(s);
  b.free(out);
}

}  // namespace
}  // namespace metrale::cuda::testing
