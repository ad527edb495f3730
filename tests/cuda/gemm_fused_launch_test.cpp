// The persistent fused route on the CUDA backend over the fake driver: gemm_fused publishes
// _persistent (it loops over its tiles), so w4a16_gemm launches it as one wave, a 1-D grid of
// min(tiles, SMs x blocks_per_sm) blocks, never a block per tile. Planned with the real module's
// sm_90a values, and run through the fake model's persistent twin (reliability/fake_model.h),
// whose blocks each take several tiles, against the float64 reference.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "kernels/decode_layout.h"
#include "kernels/fused_tile.h"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/error.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "ops/gemm_reference.h"
#include "reliability/fake_model.h"

namespace metrale::cuda::testing {
namespace {

namespace ref = metrale::testing::gemm;
namespace dl = metrale::decode_layout;
namespace fu = metrale::fused;
namespace rel = metrale::testing::reliability;
using metrale::testing::expect_error;
using ::testing::HasSubstr;

// What gemm_fused publishes beyond its launch shape.
struct FusedPublished {
  bool persistent = true;
  std::uint32_t blocks_per_sm = 1;
};

// The w4a16 module's decode-layout kernels with the real module's sm_90a values (planning only:
// no bodies, nothing launched).
ModuleSpec fused_module(const FusedPublished& pub = {}) {
  ModuleSpec m;
  m.name = "w4a16";
  for (const char* e : {"gemm_decode", "gemm_decode_packed", "gemm_fused"}) {
    m.fake.functions[e] = FakeFunction{{}, {sizeof(GemmParams)}};
    m.entries.emplace_back(e);
  }
  m.fake.publish_u32("gemm_decode_n_tile", tiles::kDecodeNTile)
      .publish_u32("gemm_decode_block_threads", tiles::kDecodeThreads)
      .publish_u32("gemm_decode_max_m", tiles::kDecodeMaxM)
      .publish_u32("gemm_decode_packed_n_tile", dl::kTileN)
      .publish_u32("gemm_decode_packed_block_threads", tiles::kDecodeThreads)
      .publish_u32("gemm_decode_packed_layout", dl::kLayoutId)
      .publish_u32("gemm_fused_n_tile", fu::kRows)
      .publish_u32("gemm_fused_m_tile", fu::kTokens)
      .publish_u32("gemm_fused_smem_bytes", fu::kSmemBytes)
      .publish_u32("gemm_fused_block_threads", fu::kThreads)
      .publish_u32("gemm_fused_layout", dl::kLayoutId);
  if (pub.persistent) m.fake.publish_u32("gemm_fused_persistent", 1);
  if (pub.blocks_per_sm != 0) m.fake.publish_u32("gemm_fused_blocks_per_sm", pub.blocks_per_sm);
  return m;
}

FakeDevice device_with_sms(int sms) {
  FakeDevice d;
  d.sm_count = sms;
  return d;
}

// NVFP4 weights [n, k] in the decode layout at addresses plan() only checks (never read).
ops::QuantWeights planned_weights(std::int64_t n, std::int64_t k) {
  ops::QuantWeights w;
  w.format = WeightFormat::kNvfp4;
  w.packing = ops::WeightPacking::kDecode;
  w.fold = dl::kNvfp4Fold;
  w.n = n;
  w.k = k;
  w.codes = DevicePtr{0x100000};
  w.scales = DevicePtr{0x200000};
  w.codes_bytes = static_cast<std::size_t>(dl::code_bytes(n, k));
  w.scales_bytes = static_cast<std::size_t>(dl::scale_bytes(n, k, false));
  return w;
}

ops::GemmPlan plan_fused(CudaBackend& b, std::int64_t m, std::int64_t n, std::int64_t k) {
  ops::GemmOptions o;
  o.route = ops::GemmRoute::kFused;
  return ops::plan(b, m, planned_weights(n, k), o);
}

// Llama-3 8B gate/up at M = 4096 is 32 x 224 = 7168 tiles, 54 waves of one block a tile on an
// H200; persistent, it is one wave of 132 blocks, each looping over ~54 tiles.
TEST(GemmFusedLaunch, APersistentKernelIsLaunchedAsOneWaveOfBlocks) {
  Rig rig(
      RigOptions{.devices = {device_with_sms(132)}, .modules = {core_module(), fused_module()}});
  ASSERT_EQ(fu::fused_tiles(4096, 28672), 7168);
  const ops::GemmPlan p = plan_fused(rig.b(), 4096, 28672, 4096);
  ASSERT_EQ(p.launches.size(), 1u);
  const ops::PlannedLaunch& g = p.launches[0];
  EXPECT_EQ(rig.b().kernel_name(g.kernel), "w4a16::gemm_fused");
  EXPECT_EQ(g.grid, (Dim3{132, 1, 1})) << p.describe();
  EXPECT_EQ(g.block, (Dim3{static_cast<std::uint32_t>(fu::kThreads), 1, 1}));
  EXPECT_EQ(g.smem_bytes, static_cast<std::uint32_t>(fu::kSmemBytes));
  EXPECT_EQ(p.splits, 1);
  EXPECT_EQ(p.workspace.total(), 0u);
}

// Fewer tiles than a wave: a block per tile. M = 100, N = 200 is 1 x 2 tiles, 2 blocks on 132
// SMs (as the 2-D grid of old); on a one-SM device its wave is one block, which takes both.
TEST(GemmFusedLaunch, AProblemOfFewerTilesThanAWaveGetsABlockPerTile) {
  ASSERT_EQ(fu::fused_tiles(100, 200), 2);
  {
    Rig rig(
        RigOptions{.devices = {device_with_sms(132)}, .modules = {core_module(), fused_module()}});
    const ops::GemmPlan p = plan_fused(rig.b(), 100, 200, 256);
    EXPECT_EQ(p.launches.at(0).grid, (Dim3{2, 1, 1})) << p.describe();
  }
  Rig one(RigOptions{.devices = {device_with_sms(1)}, .modules = {core_module(), fused_module()}});
  const ops::GemmPlan p = plan_fused(one.b(), 100, 200, 256);
  EXPECT_EQ(p.launches.at(0).grid, (Dim3{1, 1, 1})) << p.describe();
}

// The wave is the device's SMs times the blocks per SM the kernel publishes.
TEST(GemmFusedLaunch, TheWaveIsTheSmsTimesThePublishedBlocksPerSm) {
  FusedPublished two;
  two.blocks_per_sm = 2;
  Rig rig(
      RigOptions{.devices = {device_with_sms(132)}, .modules = {core_module(), fused_module(two)}});
  EXPECT_EQ(plan_fused(rig.b(), 4096, 28672, 4096).launches.at(0).grid, (Dim3{264, 1, 1}));
}

// More tiles than the kernel's 32-bit tile count holds (65535 x 32769 > 2^31 - 1: M and N each
// within the grid's limits) are refused by name, nothing launched.
TEST(GemmFusedLaunch, MoreTilesThanThirtyTwoBitsCountIsRefused) {
  Rig rig(
      RigOptions{.devices = {device_with_sms(132)}, .modules = {core_module(), fused_module()}});
  const std::int64_t m = std::int64_t{65535} * fu::kTokens, n = std::int64_t{32769} * fu::kRows;
  const Error e = expect_error([&] { (void)plan_fused(rig.b(), m, n, 256); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("2147516415 tiles for w4a16::gemm_fused"));
  EXPECT_TRUE(rig.fd.launches().empty());
}

// A persistent kernel that publishes no blocks per SM is refused by name when planning: its grid
// cannot be sized without one. A kernel that is not persistent keeps a block per tile.
TEST(GemmFusedLaunch, APersistentKernelWithoutBlocksPerSmIsRefusedNamingIt) {
  {
    FusedPublished none;
    none.blocks_per_sm = 0;
    Rig rig(RigOptions{.modules = {core_module(), fused_module(none)}});
    const Error e = expect_error([&] { (void)plan_fused(rig.b(), 4096, 28672, 4096); });
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_THAT(e.what(), HasSubstr("[plan] w4a16::gemm_fused publishes no blocks per SM"));
    EXPECT_TRUE(rig.fd.launches().empty());
  }
  FusedPublished tiled;
  tiled.persistent = false;
  Rig rig(RigOptions{.modules = {core_module(), fused_module(tiled)}});
  EXPECT_EQ(plan_fused(rig.b(), 4096, 28672, 4096).launches.at(0).grid, (Dim3{224, 32, 1}));
}

// The fake model's gemm_fused (reliability/fake_model.h: tiles of 24 rows x 8 columns, the CPU
// twin of the decode-layout kernel per tile) run on its one-wave grid: 150 tiles on 132 SMs, so
// some blocks take two; and 5 tiles, a block each. C is poisoned, with a poisoned tail.
TEST(GemmFusedLaunch, TheFakeModelsPersistentTwinComputesC) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  rel::FakeProcess proc;
  std::unique_ptr<Backend> b = proc.make_backend();
  ASSERT_EQ(b->sm_count(), 132u);
  struct Case {
    std::int64_t m, n, k;
    WeightFormat format;
    std::uint32_t grid;
  };
  for (const Case& c :
       {Case{50, 400, 256, WeightFormat::kNvfp4, 132}, Case{20, 40, 64, WeightFormat::kMxfp4, 5}}) {
    SCOPED_TRACE(fmt::format("M={} N={} K={}", c.m, c.n, c.k));
    const HostQuantWeights host =
        ref::quantize(c.format, ref::random_weight_values(gen, c.n, c.k), c.n, c.k);
    ops::QuantWeights w = ops::upload_weights(*b, host, ops::UploadLayout::kDecode);
    const auto a = ref::random_activations(gen, static_cast<std::size_t>(c.m * c.k));
    const auto bias = ref::random_bias(gen, c.n);
    const DevicePtr da = b->alloc(a.size() * 2), db = b->alloc(bias.size() * 2);
    b->copy_h2d(da, a.data(), a.size() * 2);
    b->copy_h2d(db, bias.data(), bias.size() * 2);
    const auto elems = static_cast<std::size_t>(c.m * c.n);
    const DevicePtr dc = b->alloc((elems + ref::kTailElems) * 2);
    b->memset(dc, ref::kPoisonByte, (elems + ref::kTailElems) * 2);
    ops::GemmOptions o;
    o.route = ops::GemmRoute::kFused;
    o.bias = db;
    const std::size_t before = proc.fd.launches().size();
    ops::w4a16_gemm(*b, b->default_stream(), da, c.m, w, dc, o);
    b->synchronize(b->default_stream());
    const auto launches = proc.fd.launches();
    ASSERT_EQ(launches.size(), before + 1);
    EXPECT_EQ(launches.back().function, "gemm_fused");
    EXPECT_EQ(launches.back().grid[0], c.grid);
    EXPECT_EQ(launches.back().grid[1], 1u);
    std::vector<std::uint16_t> out(elems + ref::kTailElems);
    b->copy_d2h(out.data(), dc, out.size() * 2);
    for (std::size_t i = elems; i < out.size(); ++i) EXPECT_EQ(out[i], ref::kPoisonBf16) << i;
    out.resize(elems);
    ref::expect_close(ref::compare(out, ref::reference(a, c.m, host, bias, ref::AMode::kBf16)),
                      ref::kNormTol, fmt::format("fused M={} N={} K={}", c.m, c.n, c.k));
    b->free(dc);
    b->free(db);
    b->free(da);
    ops::free_weights(*b, w);
  }
}

}  // namespace
}  // namespace metrale::cuda::testing
