// The backend contract on a real GPU. Every test skips, saying why, where no usable CUDA device
// is present (this machine, CI); scripts/device-check.sh runs them on an H100/H200.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/tile_math.h"
#include "metrale/backend.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "metrale/runtime.h"

namespace metrale {
namespace {

// A CUDA backend in a model scope, or the reason there is none.
std::unique_ptr<ModelScope> cuda_model(std::string* why) {
  try {
    return std::make_unique<ModelScope>(create_backend("cuda"));
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
}

#define REQUIRE_GPU(model)        \
  std::string why_;               \
  auto model = cuda_model(&why_); \
  if (!model) GTEST_SKIP() << "no usable GPU: " << why_

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(Gpu, DeviceIsDescribed) {
  REQUIRE_GPU(model);
  Backend& b = model->backend();
  EXPECT_EQ(b.name(), "cuda");
  EXPECT_FALSE(b.device_name().empty());
  EXPECT_GT(b.sm_count(), 0u);
  EXPECT_GT(b.total_memory(), b.driver_free_memory() / 2);
  EXPECT_TRUE(b.has_module("core"));
}

TEST(Gpu, PublishedTilesComeFromTheEmbeddedModule) {
  REQUIRE_GPU(model);
  Backend& b = model->backend();
  EXPECT_EQ(b.kernel_n_tile(b.op_cache().kernel(b, "core", "fill_u32")), 256u);
  EXPECT_EQ(b.kernel_n_tile(b.op_cache().kernel(b, "core", "axpy_f32")), 1024u);
}

// The driver picked the w4a16 code for this device: on Hopper the wgmma kernels (their tiles from
// tile_math.h), elsewhere the fallback, never a mix.
TEST(Gpu, W4a16PublishesTheLaunchShapesOfTheCodeTheDriverLoaded) {
  REQUIRE_GPU(model);
  Backend& b = model->backend();
  const ResolvedKernel& tiled = b.op_cache().kernel(b, "w4a16", "gemm_tiled");
  const ResolvedKernel& e4m3 = b.op_cache().kernel(b, "w4a16", "gemm_e4m3");
  const ResolvedKernel& decode = b.op_cache().kernel(b, "w4a16", "gemm_decode");
  const KernelMeta t = tiled.meta, e = e4m3.meta;
  const bool hopper = b.kernel_n_tile(tiled) == tiles::kTiledNTile;
  const std::string name = b.device_name();
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) {
    EXPECT_TRUE(hopper) << name << " did not load the sm_90a code";
  }
  if (hopper) {
    EXPECT_EQ(t.m_tile, std::uint32_t{tiles::kTiledMTile});
    EXPECT_EQ(t.smem_bytes, std::uint32_t{tiles::kTiledSmemBytes});
    EXPECT_EQ(b.kernel_n_tile(e4m3), std::uint32_t{tiles::kE4m3NTile});
    EXPECT_EQ(e.m_tile, std::uint32_t{tiles::kE4m3MTile});
    EXPECT_EQ(e.smem_bytes, std::uint32_t{tiles::kE4m3SmemBytes});
  } else {
    EXPECT_EQ(t.m_tile, 0u);
    EXPECT_EQ(t.smem_bytes, 0u);
    EXPECT_EQ(e.m_tile, 0u);
  }
  EXPECT_EQ(b.kernel_n_tile(decode), std::uint32_t{tiles::kDecodeNTile});
  EXPECT_EQ(decode.meta.split_k, std::uint32_t{tiles::kDecodeSplitUnit});
  EXPECT_EQ(decode.meta.max_m, std::uint32_t{tiles::kDecodeMaxM});
  for (const ResolvedKernel* k : {&tiled, &e4m3, &decode}) EXPECT_EQ(k->meta.block_threads, 256u);
}

TEST(Gpu, ElementwiseOpsMatchTheCpuBackend) {
  REQUIRE_GPU(model);
  Backend& b = model->backend();
  const std::size_t n = 3'000'017;
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  const auto x = random_floats(n, seed), y = random_floats(n, seed + 1);
  const DevicePtr dx = model->alloc_buffer("x", n * 4), dy = model->alloc_buffer("y", n * 4);
  b.copy_h2d(dx, x.data(), n * 4);
  b.copy_h2d(dy, y.data(), n * 4);
  ops::axpy_f32(b, b.default_stream(), dy, dx, 1.5f, n);
  std::vector<float> gpu(n);
  b.copy_d2h(gpu.data(), dy, n * 4);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double ref = 1.5 * double{x[i]} + y[i];
    num += (gpu[i] - ref) * (gpu[i] - ref);
    den += ref * ref;
  }
  EXPECT_LT(std::sqrt(num / den), 1e-6);

  const DevicePtr f = model->alloc_buffer("fill", n * 4);
  b.memset(f, 0xAB, n * 4);
  ops::fill_u32(b, b.default_stream(), f, n, 0x12345678u);
  std::vector<std::uint32_t> out(n);
  b.copy_d2h(out.data(), f, n * 4);
  EXPECT_EQ(std::count(out.begin(), out.end(), 0x12345678u), static_cast<long>(n));
}

TEST(Gpu, GraphsReplayAndEventsComplete) {
  REQUIRE_GPU(model);
  Backend& b = model->backend();
  const std::size_t n = 1 << 20;
  const auto x = random_floats(n, 7), y = random_floats(n, 8);
  const DevicePtr dx = model->alloc_buffer("x", n * 4), dy = model->alloc_buffer("y", n * 4);
  b.copy_h2d(dx, x.data(), n * 4);
  b.copy_h2d(dy, y.data(), n * 4);
  b.op_cache().kernel(b, "core", "axpy_f32");  // resolve before capture
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  EXPECT_TRUE(b.is_capturing(s));
  ops::axpy_f32(b, s, dy, dx, 0.5f, n);
  const GraphHandle g = b.end_capture(s);
  for (int i = 0; i < 4; ++i) b.launch_graph(g, s);
  const EventHandle e = b.create_event();
  b.record_event(e, s);
  b.event_synchronize(e);
  EXPECT_EQ(b.event_query(e), EventStatus::kDone);
  std::vector<float> out(n);
  b.copy_d2h_after(out.data(), dy, n * 4, s);
  for (std::size_t i = 0; i < n; i += 4099) EXPECT_NEAR(out[i], y[i] + 2.0f * x[i], 1e-5f) << i;
  b.destroy_event(e);
  b.destroy_graph(g);
  b.destroy_stream(s);
}

TEST(Gpu, PinnedMemoryAndGuardBands) {
  REQUIRE_GPU(model);
  Backend& b = model->backend();
  void* pinned = b.alloc_pinned(1 << 20);
  EXPECT_TRUE(b.pinned_device_address(pinned));
  std::memset(pinned, 0x5A, 1 << 20);
  const DevicePtr d = model->alloc_buffer("pinned copy", 1 << 20);
  b.copy_h2d_async(d, pinned, 1 << 20, b.default_stream());  // waits: pinned source
  std::vector<std::uint8_t> back(1 << 20);
  b.copy_d2h(back.data(), d, back.size());
  EXPECT_EQ(back[12345], 0x5A);
  b.free_pinned(pinned);

  b.set_guard_bands(GuardBandConfig{64, 0, kGuardFill});
  const DevicePtr guarded = b.alloc(1000);
  std::vector<std::uint8_t> over(1008, 0x11);
  b.copy_h2d(guarded, over.data(), over.size());  // 8 bytes into the pad
  EXPECT_EQ(b.scan_redzones(), 1u);
  EXPECT_EQ(b.scan_redzones(), 0u);
  b.free(guarded);
}

TEST(Gpu, TeardownLeavesZeroBytes) {
  REQUIRE_GPU(model);
  const LedgerProbe probe = model->backend().ledger_probe();
  model->alloc_buffer("weights", 64 << 20);
  model->backend().op_cache().scratch(model->backend(), "fp8_activation", 1 << 20);
  const TeardownReport r = model->teardown();
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(probe.live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale
