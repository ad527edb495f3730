// How w4a16_gemm sizes a launch from what the kernel publishes, on the fake driver: grid y from
// <entry>_m_tile, dynamic shared memory from <entry>_smem_bytes, and split-K over grid z from
// <entry>_split_k, by waves of SMs x <entry>_blocks_per_sm blocks, with an FP32 workspace that
// gemm_split_reduce sums. The fake kernels compute
// only the part of C that the launched grid covers (block y → its M rows, block z → its K
// slice), so a launch sized any other way leaves poisoned outputs or wrong sums.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cuda/fake_gemm.h"
#include "cuda/rig.h"
#include "kernels/gemm_params.h"
#include "kernels/manifest.h"
#include "kernels/tile_math.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/ops/gemm.h"
#include "ops/gemm_reference.h"

namespace metrale::cuda::testing {
namespace {

namespace ref = metrale::testing::gemm;
using metrale::testing::expect_error;
using ::testing::HasSubstr;

// Deliberately small and odd, so several blocks, slices and a partial last slice appear on
// small shapes.
constexpr std::uint32_t kDecodeTile = 8, kSplitUnit = 64, kTiledTile = 16, kTiledMTile = 8;
constexpr std::uint32_t kTiledSmem = 64 * 1024, kReduceTile = 128;
// Unlike the real kernels' 256: a launch with any block but the published one is caught.
constexpr std::uint32_t kBlockThreads = 96;
// gemm_decode's blocks per SM: unlike the real kernel's 1 and the old constant target of 2, so a
// split planned from anything but the published value is caught.
constexpr std::uint32_t kDecodeBlocksPerSm = 3;

// W[n, k] from the device buffers GemmParams points at (fake device memory is host memory).
float weight_of(const GemmParams& p, std::int64_t n, std::int64_t k) {
  const bool mx = p.flags & kGemmMxfp4, tr = p.flags & kGemmTransposed;
  const auto* codes = at<const std::uint8_t>(p.codes);
  const std::uint8_t byte = tr ? codes[(k / 2) * p.n + n] : codes[n * (p.k / 2) + k / 2];
  const auto code = static_cast<std::uint8_t>((k & 1) ? byte >> 4 : byte & 0xF);
  const std::int64_t group = mx ? num::kMxfp4Group : num::kNvfp4Group, g = k / group;
  const auto* s = at<const std::uint8_t>(p.scales);
  const std::uint8_t sb = tr ? s[g * p.n + n] : s[n * (p.k / group) + g];
  return num::e2m1_to_f32(code) * (mx ? num::e8m0_to_f32(sb) : num::e4m3_to_f32(sb));
}

float dot(const GemmParams& p, std::int64_t m, std::int64_t n, std::int64_t k0, std::int64_t k1) {
  const auto* a = at<const std::uint16_t>(p.a);
  float sum = 0.0f;
  for (std::int64_t k = k0; k < k1; ++k)
    sum += num::bf16_to_f32(a[m * p.k + k]) * weight_of(p, n, k);
  return sum;
}

// gemm_decode that can split K, from the source layout (fake_gemm.h).
FakeFunction split_decode() {
  return fake_split_decode(kDecodeTile, weight_of);
}

// gemm_tiled with an M tile// gemm_tiled with an M tile: block (x, y) writes rows [y·kTiledMTile,
// +kTiledMTile) of its columns, and nothing unless the launch gave it the shared memory it
// publishes.
FakeFunction m_tiled() {
  FakeFunction f;
  f.param_sizes = {sizeof(GemmParams)};
  f.body = [](const FakeLaunch& l) {
    if (l.shared_bytes < kTiledSmem) return;
    const auto p = read_param<GemmParams>(l.params, 0);
    for (std::int64_t by = 0; by < l.grid[1]; ++by) {
      for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
        for (std::int64_t n = bx * kTiledTile; n < (bx + 1) * kTiledTile && n < p.n; ++n) {
          for (std::int64_t m = by * kTiledMTile; m < (by + 1) * kTiledMTile && m < p.m; ++m) {
            store_c(p, m, n, dot(p, m, n, 0, p.k));
          }
        }
      }
    }
  };
  return f;
}

ModuleSpec launch_module() {
  ModuleSpec m;
  m.name = "w4a16";
  m.fake.functions["gemm_decode"] = split_decode();
  m.fake.functions["gemm_split_reduce"] = fake_split_reduce(kReduceTile);
  m.fake.functions["gemm_tiled"] = m_tiled();
  m.fake.publish_u32("gemm_decode_n_tile", kDecodeTile)
      .publish_u32("gemm_decode_split_k", kSplitUnit)
      .publish_u32("gemm_decode_blocks_per_sm", kDecodeBlocksPerSm)
      .publish_u32("gemm_split_reduce_n_tile", kReduceTile)
      .publish_u32("gemm_tiled_n_tile", kTiledTile)
      .publish_u32("gemm_tiled_m_tile", kTiledMTile)
      .publish_u32("gemm_tiled_smem_bytes", kTiledSmem)
      .publish_u32("gemm_decode_max_m", 16);
  m.entries = {"gemm_decode", "gemm_split_reduce", "gemm_tiled"};
  for (const std::string& e : m.entries) m.fake.publish_u32(e + "_block_threads", kBlockThreads);
  return m;
}

struct Case {
  std::int64_t m, n, k;
};

// Runs one GEMM on fresh data through the route and checks it against the float64 reference,
// every element written and nothing past C. Returns C's bits.
std::vector<std::uint16_t> run_checked(Rig& rig, ops::GemmRoute route, const Case& c,
                                       std::mt19937_64& gen, WeightFormat format, bool with_bias) {
  CudaBackend& b = rig.b();
  const auto wv = ref::random_weight_values(gen, c.n, c.k);
  const HostQuantWeights hw = ref::quantize(format, wv, c.n, c.k);
  const auto a = ref::random_activations(gen, static_cast<std::size_t>(c.m * c.k));
  const auto bias = with_bias ? ref::random_bias(gen, c.n) : std::vector<std::uint16_t>{};
  ops::QuantWeights w = ops::upload_weights(b, hw);
  const DevicePtr da = b.alloc(a.size() * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  DevicePtr db;
  if (with_bias) {
    db = b.alloc(bias.size() * 2);
    b.copy_h2d(db, bias.data(), bias.size() * 2);
  }
  const auto out_elems = static_cast<std::size_t>(c.m * c.n);
  const DevicePtr dc = b.alloc((out_elems + ref::kTailElems) * 2);
  b.memset(dc, ref::kPoisonByte, (out_elems + ref::kTailElems) * 2);
  ops::GemmOptions opt;
  opt.route = route;
  opt.bias = db;
  const StreamHandle s = b.default_stream();
  ops::w4a16_gemm(b, s, da, c.m, w, dc, opt);
  b.synchronize(s);
  std::vector<std::uint16_t> out(out_elems + ref::kTailElems);
  b.copy_d2h(out.data(), dc, out.size() * 2);
  const ref::Reference r = ref::reference(a, c.m, hw, bias, ref::AMode::kBf16);
  ref::expect_close(ref::compare(out, r), ref::kNormTol, fmt::format("{}x{}x{}", c.m, c.n, c.k));
  for (std::size_t i = out_elems; i < out.size(); ++i) EXPECT_EQ(out[i], ref::kPoisonBf16) << i;
  out.resize(out_elems);
  b.free(dc);
  b.free(da);
  if (with_bias) b.free(db);
  ops::free_weights(b, w);
  return out;
}

std::vector<FakeLaunch> launches_since(Rig& rig, std::size_t from) {
  const auto all = rig.fd.launches();
  return {all.begin() + static_cast<std::ptrdiff_t>(from), all.end()};
}

TEST(GemmLaunch, SplitKSlicesKOverGridZAndTheReductionSumsThem) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  const auto sms = static_cast<std::int64_t>(rig.b().sm_count());
  // N = 64: 8 blocks, far below a wave, so K is split: 1024 K is 16 units (the cap), 160 K
  // is 3 units with a half-unit last slice, 16 K is one unit and cannot split.
  struct Want {
    Case c;
    std::uint32_t splits;
  };
  for (const Want& want : {Want{{3, 64, 1024}, 16}, Want{{2, 64, 160}, 3}, Want{{1, 64, 16}, 1},
                           Want{{5, 40, 320}, 5}}) {
    const Case& c = want.c;
    SCOPED_TRACE(fmt::format("M={} N={} K={}", c.m, c.n, c.k));
    const tiles::SplitK plan = tiles::plan_split_k_waves(
        c.k, kSplitUnit, (c.n + kDecodeTile - 1) / kDecodeTile, kDecodeBlocksPerSm * sms, 16);
    ASSERT_EQ(plan.splits, want.splits);
    for (WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
      if (c.k % group_size(format) != 0) continue;
      const std::size_t before = rig.fd.launches().size();
      run_checked(rig, ops::GemmRoute::kDecode, c, gen, format, /*with_bias=*/true);
      const auto ls = launches_since(rig, before);
      ASSERT_EQ(ls.size(), want.splits > 1 ? 2u : 1u);
      EXPECT_EQ(ls[0].function, "gemm_decode");
      EXPECT_EQ(ls[0].grid[0], (c.n + kDecodeTile - 1) / kDecodeTile);
      EXPECT_EQ(ls[0].grid[1], 1u);
      EXPECT_EQ(ls[0].grid[2], want.splits);
      if (want.splits > 1) {
        EXPECT_EQ(ls[1].function, "gemm_split_reduce");
        EXPECT_EQ(ls[1].grid[0], (c.m * c.n + kReduceTile - 1) / kReduceTile);
        // The workspace is OpCache scratch: [splits, M, N] FP32, the one buffer left.
        EXPECT_GE(rig.b().live_bytes(), want.splits * c.m * c.n * sizeof(float));
      }
    }
  }
  rig.b().op_cache().release(rig.b());
  EXPECT_EQ(rig.b().live_bytes(), 0u);
}

// A split plan whose K slices were edited is refused at run(), before any launch: slices that
// leave K's end unsummed, one that starts past K, slices off the kernel's 64-K unit, none, and a
// one-slice plan that is not all of K.
TEST(GemmLaunch, EditedKSlicesAreRefusedBeforeAnyLaunch) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  CudaBackend& b = rig.b();
  const Case c{3, 64, 1024};
  const HostQuantWeights hw =
      ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, c.n, c.k), c.n, c.k);
  ops::QuantWeights w = ops::upload_weights(b, hw);
  const DevicePtr da = b.alloc(static_cast<std::size_t>(c.m * c.k) * 2);
  const DevicePtr dc = b.alloc(static_cast<std::size_t>(c.m * c.n) * 2);
  const ops::GemmPlan p = ops::plan(b, c.m, w);
  ASSERT_EQ(p.splits, 16);
  ASSERT_EQ(p.k_per_split, 64);
  const DevicePtr ws = b.alloc(p.workspace.total());
  const ops::GemmWorkspace parts = ops::GemmWorkspace::carve(ws, p.workspace);
  struct Edit {
    std::int64_t splits, k_per_split;
  };
  // 11 slices of 96 cover K with none empty, but start off the 64-K unit (the grid edited too).
  for (const Edit e :
       {Edit{16, 32}, Edit{16, 128}, Edit{11, 96}, Edit{16, 0}, Edit{16, -64}, Edit{1, 64}}) {
    SCOPED_TRACE(fmt::format("{} split(s) of {}", e.splits, e.k_per_split));
    ops::GemmPlan edited = p;
    edited.splits = e.splits;
    edited.k_per_split = e.k_per_split;
    if (e.splits > 1) edited.launches[0].grid.z = static_cast<std::uint32_t>(e.splits);
    const std::size_t before = rig.fd.launches().size();
    const Error err = expect_error([&] { ops::run(edited, b.default_stream(), da, w, dc, parts); });
    EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument) << err.what();
    EXPECT_THAT(err.what(), ::testing::HasSubstr("the plan does not fit itself"));
    EXPECT_EQ(rig.fd.launches().size(), before);
  }
  // The plan as made runs.
  ops::run(p, b.default_stream(), da, w, dc, parts);
  b.synchronize(b.default_stream());
  b.free(ws);
  b.free(dc);
  b.free(da);
  ops::free_weights(b, w);
}

TEST(GemmLaunch, EnoughColumnBlocksMeanNoSplitAndNoWorkspace) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  // A full wave (kDecodeBlocksPerSm blocks on every SM) from N alone.
  const std::int64_t n =
      kDecodeBlocksPerSm * static_cast<std::int64_t>(rig.b().sm_count()) * kDecodeTile;
  const std::size_t before = rig.fd.launches().size();
  run_checked(rig, ops::GemmRoute::kDecode, Case{1, n, 256}, gen, WeightFormat::kNvfp4, false);
  const auto ls = launches_since(rig, before);
  ASSERT_EQ(ls.size(), 1u);
  EXPECT_EQ(ls[0].grid[2], 1u);
  EXPECT_EQ(rig.b().live_bytes(), 0u);  // no workspace was taken
}

// A plan that does not split K has one slice of all of K, not of K rounded up to the split unit:
// ops::run checks the plan it is given, and refused the unit's round-up ("does not fit itself")
// for every unsplit decode plan of a K off the unit (gpt-oss's 2880 against CUDA's 1024).
TEST(GemmLaunch, AnUnsplitPlanOfKOffTheUnitRunsAsPlanned) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  CudaBackend& b = rig.b();
  const std::int64_t n = kDecodeBlocksPerSm * static_cast<std::int64_t>(b.sm_count()) * kDecodeTile;
  const Case c{1, n, kSplitUnit + 32};
  const HostQuantWeights hw =
      ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, c.n, c.k), c.n, c.k);
  ops::QuantWeights w = ops::upload_weights(b, hw);
  const auto a = ref::random_activations(gen, static_cast<std::size_t>(c.m * c.k));
  const DevicePtr da = b.alloc(a.size() * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  const DevicePtr dc = b.alloc(static_cast<std::size_t>(c.m * c.n) * 2);
  b.memset(dc, ref::kPoisonByte, static_cast<std::size_t>(c.m * c.n) * 2);
  const ops::GemmPlan p = ops::plan(b, c.m, w);
  EXPECT_EQ(p.splits, 1) << p.describe();
  EXPECT_EQ(p.k_per_split, c.k) << p.describe();
  ops::run(p, b.default_stream(), da, w, dc, ops::GemmWorkspace{});
  b.synchronize(b.default_stream());
  std::vector<std::uint16_t> out(static_cast<std::size_t>(c.m * c.n));
  b.copy_d2h(out.data(), dc, out.size() * 2);
  ref::expect_close(ref::compare(out, ref::reference(a, c.m, hw, {}, ref::AMode::kBf16)),
                    ref::kNormTol, "against float64");
  b.free(dc);
  b.free(da);
  ops::free_weights(b, w);
}

// A grid past one wave splits K where that fills its last wave: N = 4752 is 594 blocks, 1.5 waves
// of 396 (75% busy); 2 slices make 1188 blocks, 3 full waves. Computed through the fake kernels
// and the reduction, checked against the reference.
TEST(GemmLaunch, SplitKFillsTheLastWaveOfAGridPastOneWave) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  const std::int64_t wave = kDecodeBlocksPerSm * static_cast<std::int64_t>(rig.b().sm_count());
  ASSERT_EQ(wave, 396);
  const Case c{2, 4752, 256};
  const std::int64_t blocks = c.n / kDecodeTile;
  EXPECT_DOUBLE_EQ(tiles::wave_efficiency(blocks, wave), 0.75);
  EXPECT_DOUBLE_EQ(tiles::wave_efficiency(2 * blocks, wave), 1.0);
  const std::size_t before = rig.fd.launches().size();
  run_checked(rig, ops::GemmRoute::kDecode, c, gen, WeightFormat::kNvfp4, /*with_bias=*/true);
  const auto ls = launches_since(rig, before);
  ASSERT_EQ(ls.size(), 2u);
  EXPECT_EQ(ls[0].grid[0], static_cast<std::uint32_t>(blocks));
  EXPECT_EQ(ls[0].grid[2], 2u);
  EXPECT_EQ(ls[1].function, "gemm_split_reduce");
  rig.b().op_cache().release(rig.b());
}

// A kernel that can split K but publishes no blocks per SM is refused by name when planning: the
// split's wave cannot be sized without it.
TEST(GemmLaunch, ASplitKKernelWithoutBlocksPerSmIsRefusedNamingIt) {
  ModuleSpec spec = launch_module();
  spec.fake.globals.erase("gemm_decode_blocks_per_sm");
  Rig rig(RigOptions{.modules = {core_module(), spec}});
  CudaBackend& b = rig.b();
  std::vector<float> wv(16 * 64, 0.5f);
  ops::QuantWeights w = ops::upload_weights(b, quantize_nvfp4(wv, 16, 64));
  ops::GemmOptions opt;
  opt.route = ops::GemmRoute::kDecode;
  const std::size_t before = rig.fd.launches().size();
  const Error e = expect_error([&] { (void)ops::plan(b, 1, w, opt); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[plan] w4a16::gemm_decode publishes no blocks per SM"));
  EXPECT_EQ(rig.fd.launches().size(), before);
  ops::free_weights(b, w);
}

TEST(GemmLaunch, SplitKResultsAreTheSameBitsEveryRun) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  std::mt19937_64 g1(seed), g2(seed);
  const Case c{4, 48, 2048};
  const auto first = run_checked(rig, ops::GemmRoute::kDecode, c, g1, WeightFormat::kNvfp4, true);
  const auto second = run_checked(rig, ops::GemmRoute::kDecode, c, g2, WeightFormat::kNvfp4, true);
  EXPECT_EQ(first, second);
  rig.b().op_cache().release(rig.b());
}

TEST(GemmLaunch, MTileSetsGridYAndSmemBytesTheDynamicSharedMemory) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  for (const Case& c : {Case{37, 50, 64}, Case{8, 16, 32}, Case{65, 33, 96}}) {
    SCOPED_TRACE(fmt::format("M={} N={} K={}", c.m, c.n, c.k));
    const std::size_t before = rig.fd.launches().size();
    run_checked(rig, ops::GemmRoute::kTiled, c, gen, WeightFormat::kNvfp4, true);
    const auto ls = launches_since(rig, before);
    ASSERT_EQ(ls.size(), 1u);
    EXPECT_EQ(ls[0].grid[0], (c.n + kTiledTile - 1) / kTiledTile);
    EXPECT_EQ(ls[0].grid[1], (c.m + kTiledMTile - 1) / kTiledMTile);
    EXPECT_EQ(ls[0].grid[2], 1u);
    EXPECT_EQ(ls[0].shared_bytes, kTiledSmem);
  }
}

TEST(GemmLaunch, AnMGridBeyondOneLaunchIsRefusedBeforeAnythingRuns) {
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  CudaBackend& b = rig.b();
  const std::int64_t m = std::int64_t{0x10000} * kTiledMTile + 1, n = 16, k = 16;
  std::vector<float> wv(static_cast<std::size_t>(n * k), 0.5f);
  ops::QuantWeights w = ops::upload_weights(b, quantize_nvfp4(wv, n, k));
  const DevicePtr a = b.alloc(static_cast<std::size_t>(m * k * 2));
  const DevicePtr c = b.alloc(static_cast<std::size_t>(m * n * 2));
  const std::size_t before = rig.fd.launches().size();
  ops::GemmOptions opt;
  opt.route = ops::GemmRoute::kTiled;
  const Error e = expect_error([&] { ops::w4a16_gemm(b, b.default_stream(), a, m, w, c, opt); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("w4a16_gemm"));
  EXPECT_THAT(e.what(), HasSubstr("one launch holds at most 65535"));
  EXPECT_EQ(rig.fd.launches().size(), before);
  b.free(c);
  b.free(a);
  ops::free_weights(b, w);
}

TEST(GemmLaunch, EveryLaunchTakesTheBlockSizeItsKernelPublishes) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), launch_module()}});
  for (const ops::GemmRoute route : {ops::GemmRoute::kDecode, ops::GemmRoute::kTiled}) {
    const std::size_t before = rig.fd.launches().size();
    run_checked(rig, route, Case{3, 40, 256}, gen, WeightFormat::kNvfp4, false);
    const auto ls = launches_since(rig, before);
    ASSERT_FALSE(ls.empty());
    for (const auto& l : ls) {
      EXPECT_EQ(l.block[0], kBlockThreads) << l.function;
      EXPECT_EQ(l.block[1], 1u) << l.function;
    }
  }
  // The decode route's split-K scratch, held by the OpCache, back before the rig checks for leaks.
  rig.b().op_cache().release(rig.b());
  EXPECT_EQ(rig.b().live_bytes(), 0u);
}

TEST(GemmLaunch, AKernelThatPublishesNoBlockSizeIsRefusedWhenPlanningNamingIt) {
  ModuleSpec spec = launch_module();
  spec.fake.globals.erase("gemm_tiled_block_threads");
  Rig rig(RigOptions{.modules = {core_module(), spec}});
  CudaBackend& b = rig.b();
  std::vector<float> wv(16 * 32, 0.5f);
  ops::QuantWeights w = ops::upload_weights(b, quantize_nvfp4(wv, 16, 32));
  ops::GemmOptions opt;
  opt.route = ops::GemmRoute::kTiled;
  const std::size_t before = rig.fd.launches().size();
  const Error e = expect_error([&] { (void)ops::plan(b, 4, w, opt); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[plan] w4a16::gemm_tiled publishes no block size"));
  EXPECT_EQ(rig.fd.launches().size(), before);
  ops::free_weights(b, w);
}

TEST(GemmLaunch, EntriesOfTheLaunchModuleAreManifestEntries) {
  const auto& manifest = manifest::kW4a16Entries;
  for (const std::string& e : launch_module().entries) {
    EXPECT_NE(std::find(manifest.begin(), manifest.end(), e), manifest.end()) << e;
  }
}

}  // namespace
}  // namespace metrale::cuda::testing
