// Weights in the decode layout on the CUDA backend over the fake driver: the backend's preference
// packs them where the module publishes a gemm_decode_packed of layout 1 with a largest M, and
// w4a16_gemm launches that kernel on a grid of ceil(N / published tile) x 1 x splits with the
// published block. The fake kernel reads W[n, k] from the packed buffers as the real one does
// (decode_layout.h: the word's fields times the table pair in BF16, then times 2^weight_fold) and
// computes only what the launched grid covers (block x: its N tile, block z: its K slice), so a
// wrong grid, split, fold or flag leaves poisoned or wrong outputs. Also the planning of the
// real published values on the 8 Llama-3 shapes: the waves of an H200's 132 SMs are all but full.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cuda/fake_gemm.h"
#include "cuda/packed_module.h"
#include "cuda/rig.h"
#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "kernels/verified_devices.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "ops/gemm_reference.h"

namespace metrale::cuda::testing {
namespace {

namespace ref = metrale::testing::gemm;
namespace dl = metrale::decode_layout;
using metrale::testing::expect_error;
using ::testing::HasSubstr;

struct Case {
  std::int64_t m, n, k;
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  bool bias = true;
  std::string str() const {
    return fmt::format("{} {} M={} N={} K={}{}", to_string(format),
                       layout == WeightLayout::kRowMajor ? "row-major" : "transposed", m, n, k,
                       bias ? " with bias" : "");
  }
};

std::vector<FakeLaunch> launches_since(Rig& rig, std::size_t from) {
  const auto all = rig.fd.launches();
  return {all.begin() + static_cast<std::ptrdiff_t>(from), all.end()};
}

// One GEMM on fresh data, weights uploaded as the backend prefers (packed), checked against the
// float64 reference of the source weights with C poisoned and a poisoned tail. Returns C's bits.
std::vector<std::uint16_t> run_packed(Rig& rig, const Case& c, std::mt19937_64& gen) {
  CudaBackend& b = rig.b();
  HostQuantWeights row =
      ref::quantize(c.format, ref::random_weight_values(gen, c.n, c.k), c.n, c.k);
  if (c.format == WeightFormat::kMxfp4) row.tensor_scale = 1.5f;
  const HostQuantWeights host = with_layout(row, c.layout);
  ops::QuantWeights w = ops::upload_weights(b, host, ops::UploadLayout::kBackendPreferred);
  EXPECT_EQ(w.packing, ops::WeightPacking::kDecode);
  const auto a = ref::random_activations(gen, static_cast<std::size_t>(c.m * c.k));
  const auto bias = c.bias ? ref::random_bias(gen, c.n) : std::vector<std::uint16_t>{};
  const DevicePtr da = b.alloc(a.size() * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  DevicePtr db;
  if (c.bias) {
    db = b.alloc(bias.size() * 2);
    b.copy_h2d(db, bias.data(), bias.size() * 2);
  }
  const auto elems = static_cast<std::size_t>(c.m * c.n);
  const DevicePtr dc = b.alloc((elems + ref::kTailElems) * 2);
  b.memset(dc, ref::kPoisonByte, (elems + ref::kTailElems) * 2);
  ops::GemmOptions opt;
  opt.bias = db;
  const StreamHandle s = b.default_stream();
  ops::w4a16_gemm(b, s, da, c.m, w, dc, opt);
  b.synchronize(s);
  std::vector<std::uint16_t> out(elems + ref::kTailElems);
  b.copy_d2h(out.data(), dc, out.size() * 2);
  for (std::size_t i = elems; i < out.size(); ++i) EXPECT_EQ(out[i], ref::kPoisonBf16) << i;
  out.resize(elems);
  const ref::Reference r = ref::reference(a, c.m, row, bias, ref::AMode::kBf16);
  ref::expect_close(ref::compare(out, r), ref::kNormTol, c.str());
  b.free(dc);
  b.free(da);
  if (c.bias) b.free(db);
  ops::free_weights(b, w);
  return out;
}

std::uint32_t blocks(std::int64_t count, std::uint32_t tile) {
  return static_cast<std::uint32_t>((count + tile - 1) / tile);
}

TEST(GemmPackedLaunch, TheBackendsPreferencePacksWhereTheModulePublishesThePackedKernel) {
  Rig rig(RigOptions{.modules = {core_module(), packed_module()}});
  CudaBackend& b = rig.b();
  EXPECT_TRUE(ops::uploads_decode_layout(b, ops::UploadLayout::kBackendPreferred));
  std::mt19937_64 gen(ref::fresh_seed());
  const HostQuantWeights host =
      ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, 40, 80), 40, 80);
  ops::WeightsResource r(b, host, "preferred", ops::UploadLayout::kBackendPreferred);
  EXPECT_EQ(r.weights().packing, ops::WeightPacking::kDecode);
  EXPECT_EQ(r.weights().fold, dl::kNvfp4Fold);
  EXPECT_EQ(r.weights().codes_bytes, static_cast<std::size_t>(dl::code_bytes(40, 80)));
  EXPECT_EQ(r.weights().scales_bytes, static_cast<std::size_t>(dl::scale_bytes(40, 80, false)));
  EXPECT_GT(r.pack_seconds(), 0.0);
  r.release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
}

TEST(GemmPackedLaunch, SplitKOverThePublishedTileAndUnitMatchesTheReference) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), packed_module()}});
  const auto sms = static_cast<std::int64_t>(rig.b().sm_count());
  using F = WeightFormat;
  using L = WeightLayout;
  // N = 45: 4 blocks of 12, far below a wave, so K splits by 96: 1024 K is 11 slices, 160 K
  // two (the second 64 K), 96 K one. M past 16 goes through the same kernel.
  const std::vector<Case> cases = {
      {1, 45, 1024, F::kNvfp4, L::kRowMajor},   {16, 45, 160, F::kNvfp4, L::kTransposed},
      {17, 45, 160, F::kMxfp4, L::kRowMajor},   {40, 33, 96, F::kMxfp4, L::kTransposed, false},
      {2, 70, 1024, F::kMxfp4, L::kTransposed}, {9, 70, 272, F::kNvfp4, L::kRowMajor, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.str());
    const tiles::SplitK split = tiles::plan_split_k_waves(
        c.k, kPackedSplit, blocks(c.n, kPackedTile), kPackedBlocksPerSm * sms, 16);
    const std::size_t before = rig.fd.launches().size();
    run_packed(rig, c, gen);
    const auto ls = launches_since(rig, before);
    ASSERT_EQ(ls.size(), split.splits > 1 ? 2u : 1u);
    EXPECT_EQ(ls[0].function, "gemm_decode_packed");
    EXPECT_EQ(ls[0].grid[0], blocks(c.n, kPackedTile));
    EXPECT_EQ(ls[0].grid[1], 1u);
    EXPECT_EQ(ls[0].grid[2], split.splits);
    EXPECT_EQ(ls[0].block[0], kPackedThreads);
    if (c.k == 1024) {
      EXPECT_EQ(split.splits, 11);
    } else if (c.k == 160) {
      EXPECT_EQ(split.splits, 2);
    }
    if (split.splits > 1) {
      EXPECT_EQ(ls[1].function, "gemm_split_reduce");
      EXPECT_EQ(ls[1].grid[0], blocks(c.m * c.n, kReduceTile));
    }
  }
  rig.b().op_cache().release(rig.b());
  EXPECT_EQ(rig.b().live_bytes(), 0u);
}

TEST(GemmPackedLaunch, SplitKResultsAreTheSameBitsEveryRun) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  Rig rig(RigOptions{.modules = {core_module(), packed_module()}});
  std::mt19937_64 g1(seed), g2(seed);
  const Case c{4, 45, 2048, WeightFormat::kMxfp4, WeightLayout::kTransposed};
  const std::size_t before = rig.fd.launches().size();
  const auto first = run_packed(rig, c, g1);
  ASSERT_GT(launches_since(rig, before).at(0).grid[2], 1u);
  EXPECT_EQ(first, run_packed(rig, c, g2));
  rig.b().op_cache().release(rig.b());
}

// plan -> run with the split-K workspace carved from one caller's buffer (poisoned first) gives
// the same bits as w4a16_gemm with OpCache scratch.
TEST(GemmPackedLaunch, PlanAndRunWithACarvedWorkspaceMatchTheOneCall) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  Rig rig(RigOptions{.modules = {core_module(), packed_module()}});
  CudaBackend& b = rig.b();
  std::mt19937_64 gen(seed), again(seed);
  const Case c{5, 45, 1024, WeightFormat::kNvfp4, WeightLayout::kTransposed, false};
  const std::vector<std::uint16_t> one_call = run_packed(rig, c, gen);
  // The same data as run_packed drew.
  HostQuantWeights row =
      ref::quantize(c.format, ref::random_weight_values(again, c.n, c.k), c.n, c.k);
  ops::QuantWeights w =
      ops::upload_weights(b, with_layout(row, c.layout), ops::UploadLayout::kBackendPreferred);
  const auto a = ref::random_activations(again, static_cast<std::size_t>(c.m * c.k));
  const DevicePtr da = b.alloc(a.size() * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  const auto elems = static_cast<std::size_t>(c.m * c.n);
  const DevicePtr dc = b.alloc(elems * 2);
  b.memset(dc, ref::kPoisonByte, elems * 2);
  const ops::GemmPlan p = ops::plan(b, c.m, w);
  ASSERT_GT(p.splits, 1);
  EXPECT_EQ(p.packing, ops::WeightPacking::kDecode);
  EXPECT_EQ(p.fold, dl::kNvfp4Fold);
  EXPECT_THAT(p.describe(), HasSubstr("decode M=5 N=45 K=1024: w4a16::gemm_decode_packed 4x1x"));
  const DevicePtr ws = b.alloc(p.workspace.total());
  b.memset(ws, ref::kPoisonByte, p.workspace.total());
  ops::run(p, b.default_stream(), da, w, dc, ops::GemmWorkspace::carve(ws, p.workspace));
  b.synchronize(b.default_stream());
  std::vector<std::uint16_t> out(elems);
  b.copy_d2h(out.data(), dc, elems * 2);
  EXPECT_EQ(out, one_call);
  b.free(ws);
  b.free(dc);
  b.free(da);
  ops::free_weights(b, w);
  b.op_cache().release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
}

TEST(GemmPackedLaunch, EnoughColumnBlocksMeanNoSplitAndNoWorkspace) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), packed_module()}});
  // A full wave of blocks, the last of them 5 columns wide.
  const std::int64_t n =
      (kPackedBlocksPerSm * static_cast<std::int64_t>(rig.b().sm_count()) - 1) * kPackedTile + 5;
  const std::size_t before = rig.fd.launches().size();
  run_packed(rig, Case{3, n, 192, WeightFormat::kNvfp4, WeightLayout::kRowMajor, false}, gen);
  const auto ls = launches_since(rig, before);
  ASSERT_EQ(ls.size(), 1u);
  EXPECT_EQ(ls[0].grid[0], blocks(n, kPackedTile));
  EXPECT_EQ(ls[0].grid[2], 1u);
  EXPECT_EQ(rig.b().live_bytes(), 0u);  // no workspace was taken
}

TEST(GemmPackedLaunch, APackedKernelOfAnotherLayoutIsRefusedWhenPlanningNamingIt) {
  Published pub;
  pub.layout = 0;
  Rig rig(RigOptions{.modules = {core_module(), packed_module(pub)}});
  CudaBackend& b = rig.b();
  // Not what the backend prefers: it keeps the source layout.
  EXPECT_FALSE(ops::uploads_decode_layout(b, ops::UploadLayout::kBackendPreferred));
  std::vector<float> wv(40 * 64, 0.5f);
  ops::QuantWeights w =
      ops::upload_weights(b, quantize_nvfp4(wv, 40, 64), ops::UploadLayout::kDecode);
  const std::size_t before = rig.fd.launches().size();
  const Error e = expect_error([&] { (void)ops::plan(b, 4, w); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[plan] w4a16::gemm_decode_packed publishes layout 0, not the "
                                  "decode layout (1)"));
  EXPECT_EQ(rig.fd.launches().size(), before);
  ops::free_weights(b, w);
}

TEST(GemmPackedLaunch, WithoutThePackedKernelTheBackendsPreferenceKeepsTheSourceLayout) {
  {
    Published pub;
    pub.with_packed = false;
    Rig rig(RigOptions{.modules = {core_module(), packed_module(pub)}});
    CudaBackend& b = rig.b();
    EXPECT_FALSE(ops::uploads_decode_layout(b, ops::UploadLayout::kBackendPreferred));
    std::vector<float> wv(40 * 64, 0.5f);
    const HostQuantWeights host = quantize_nvfp4(wv, 40, 64);
    ops::WeightsResource r(b, host, "preferred", ops::UploadLayout::kBackendPreferred);
    EXPECT_EQ(r.weights().packing, ops::WeightPacking::kSource);
    EXPECT_EQ(r.weights().codes_bytes, host.codes.size());
    EXPECT_EQ(r.pack_seconds(), 0.0);
    r.release(b);
  }
  // A module whose packed kernel publishes no largest M is not preferred either.
  Published no_max;
  no_max.max_m = 0;
  Rig rig(RigOptions{.modules = {core_module(), packed_module(no_max)}});
  EXPECT_FALSE(ops::uploads_decode_layout(rig.b(), ops::UploadLayout::kBackendPreferred));
}

// Until a device run verifies gemm_decode_packed, the backend's preference keeps the source
// layout (the verified decode and tiled kernels read it); the decode layout is uploaded and run
// when asked for, and publishing the verification flips the preference.
TEST(GemmPackedLaunch, AnUnverifiedPackedKernelRunsOnlyWhenItsLayoutIsAskedFor) {
  std::mt19937_64 gen(ref::fresh_seed());
  const HostQuantWeights host =
      ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, 40, 64), 40, 64);
  {
    Published unverified;
    unverified.verified = false;
    Rig rig(RigOptions{.modules = {core_module(), packed_module(unverified)}});
    CudaBackend& b = rig.b();
    EXPECT_FALSE(ops::uploads_decode_layout(b, ops::UploadLayout::kBackendPreferred));
    EXPECT_EQ(ops::upload_packing(b, ops::UploadLayout::kBackendPreferred),
              ops::WeightPacking::kSource);
    // Asked for: packed, planned on gemm_decode_packed and launched.
    ops::QuantWeights w = ops::upload_weights(b, host, ops::UploadLayout::kDecode);
    EXPECT_EQ(w.packing, ops::WeightPacking::kDecode);
    const ops::GemmPlan p = ops::plan(b, 4, w);
    EXPECT_EQ(p.route, ops::GemmRoute::kDecode);
    EXPECT_THAT(p.describe(), HasSubstr("w4a16::gemm_decode_packed"));
    ops::free_weights(b, w);
  }
  Rig rig(RigOptions{.modules = {core_module(), packed_module()}});  // the same, verified
  EXPECT_EQ(ops::upload_packing(rig.b(), ops::UploadLayout::kBackendPreferred),
            ops::WeightPacking::kDecode);
}

// The real kernel's published values on an H200 (132 SMs, one block of gemm_decode_packed each).
Published real_published() {
  Published real;
  real.n_tile = dl::kTileN;
  real.split_k = tiles::kDecodeSplitUnit;
  real.threads = tiles::kDecodeThreads;
  real.max_m = tiles::kDecodeMaxM;
  real.blocks_per_sm = 1;
  return real;
}

FakeDevice h200() {
  FakeDevice d;
  d.sm_count = 132;
  return d;
}

// Weights [n, k] in the decode layout at addresses plan() only checks the alignment of.
ops::QuantWeights planned_weights(WeightFormat f, std::int64_t n, std::int64_t k) {
  ops::QuantWeights w;
  w.format = f;
  w.packing = ops::WeightPacking::kDecode;
  w.fold = dl::kNvfp4Fold;
  w.n = n;
  w.k = k;
  w.codes = DevicePtr{0x100000};
  w.scales = DevicePtr{0x200000};
  w.codes_bytes = static_cast<std::size_t>(dl::code_bytes(n, k));
  w.scales_bytes = static_cast<std::size_t>(dl::scale_bytes(n, k, f == WeightFormat::kMxfp4));
  return w;
}

// Llama-3 70B qkv at M = 1: N = 10240 is 320 blocks, 2.42 waves of 132 (the last 42% full, 81%
// overall) unsplit, as the old target of 2 blocks per SM (264, already met) left it; 2 slices of
// K = 8192 make 640 blocks, 5 waves 97% full.
TEST(GemmPackedLaunch, SeventyBQkvSplitsKToFillItsLastWave) {
  Rig rig(
      RigOptions{.devices = {h200()}, .modules = {core_module(), packed_module(real_published())}});
  const ops::GemmPlan p = ops::plan(rig.b(), 1, planned_weights(WeightFormat::kNvfp4, 10240, 8192));
  ASSERT_EQ(p.launches.size(), 2u);
  const ops::PlannedLaunch& g = p.launches[0];
  EXPECT_EQ(g.grid, (Dim3{320, 1, 2})) << p.describe();
  EXPECT_EQ(p.k_per_split, 4096);
  const double efficiency = tiles::wave_efficiency(static_cast<std::int64_t>(g.grid.volume()), 132);
  std::cout << fmt::format("[ WAVES    ] 70B qkv M=1: {}x{}x{} = {} blocks, {:.1f}% of 132 SMs\n",
                           g.grid.x, g.grid.y, g.grid.z, g.grid.volume(), 100 * efficiency);
  EXPECT_NEAR(efficiency, 640.0 / 660.0, 1e-12);
  EXPECT_NEAR(tiles::wave_efficiency(320, 132), 320.0 / 396.0, 1e-12);  // what no split gives
}

// 70B gate/up: 1792 blocks fill 14 waves 97.0%; 8 slices would fill 109 waves 99.6%, but at
// M = 16 their FP32 planes move 25% more bytes than the weights for those 2.7 points, so a split
// must gain kSplitMinGain (5%) and none is taken.
TEST(GemmPackedLaunch, AFewPointsOfWaveAreNotWorthASplit) {
  Rig rig(
      RigOptions{.devices = {h200()}, .modules = {core_module(), packed_module(real_published())}});
  ASSERT_GT(tiles::wave_efficiency(8 * 1792, 132), tiles::wave_efficiency(1792, 132));
  const ops::GemmPlan p =
      ops::plan(rig.b(), 16, planned_weights(WeightFormat::kNvfp4, 57344, 8192));
  EXPECT_EQ(p.launches.at(0).grid, (Dim3{1792, 1, 1})) << p.describe();
  EXPECT_EQ(p.workspace.split_k, 0u);
}

// On every Llama-3 8B and 70B shape at M = 1 ... 16 the planned grid keeps the 132 SMs busy for
// at least 96% of its waves (planning only: no buffers are read).
TEST(GemmPackedLaunch, TheRealPublishedValuesFillTheWavesOfAnH200) {
  Rig rig(
      RigOptions{.devices = {h200()}, .modules = {core_module(), packed_module(real_published())}});
  CudaBackend& b = rig.b();
  ASSERT_EQ(b.sm_count(), 132u);
  struct Shape {
    const char* name;
    std::int64_t n, k;
  };
  const Shape shapes[] = {
      {"8B qkv", 6144, 4096},       {"8B o", 4096, 4096},      {"8B gate/up", 28672, 4096},
      {"8B down", 4096, 14336},     {"70B qkv", 10240, 8192},  {"70B o", 8192, 8192},
      {"70B gate/up", 57344, 8192}, {"70B down", 8192, 28672},
  };
  for (const Shape& s : shapes) {
    for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
      const ops::QuantWeights w = planned_weights(f, s.n, s.k);
      for (const std::int64_t m : {1, 2, 4, 8, 16}) {
        const ops::GemmPlan p = ops::plan(b, m, w);
        ASSERT_FALSE(p.launches.empty());
        const ops::PlannedLaunch& g = p.launches[0];
        EXPECT_EQ(b.kernel_name(g.kernel), "w4a16::gemm_decode_packed");
        const std::uint64_t grid = g.grid.volume();
        const double efficiency = tiles::wave_efficiency(static_cast<std::int64_t>(grid), 132);
        EXPECT_EQ(g.grid.x, blocks(s.n, dl::kTileN));
        EXPECT_EQ(g.block.x, static_cast<std::uint32_t>(tiles::kDecodeThreads));
        EXPECT_GE(efficiency, 0.96) << s.name << " M=" << m << ": " << p.describe();
        if (f == WeightFormat::kNvfp4) {
          std::cout << fmt::format(
              "[ GRID     ] {:12} N={:5} K={:5} M={:2}: {}x{}x{} = {} blocks, waves {:.1f}% "
              "full\n",
              s.name, s.n, s.k, m, g.grid.x, g.grid.y, g.grid.z, grid, 100 * efficiency);
        }
      }
    }
  }
}

}  // namespace
}  // namespace metrale::cuda::testing
