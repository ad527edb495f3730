// The grouped W8A8 GEMM (ops/grouped_fp8.h) on the CUDA backend over the fake driver: a fake
// "fp8" module whose cast is the CPU twin (cpu/kernels/fp8_cpu.h) over the pairs of the grid it is
// launched with, and whose gemm_grouped_e4m3_block128 computes only the blocks it is launched with
// (block x its N tile of the published width, block y its expert, the expert's rows found by
// grouped_fp8::expert_rows from the device's counts and offsets) by the CPU's portable dense
// kernel. Checked: no device run has verified it, so the plan refuses it unless the caller opts
// in; opted in, the cast covers every row, the GEMM is (ceil(N / tile), experts) blocks of the
// published size, and every expert's rows match the cast-aware float64 reference, rows of no
// expert untouched.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cpu/kernels/dense_e4m3.h"
#include "cpu/kernels/fp8_cpu.h"
#include "cuda/rig.h"
#include "kernels/dense_params.h"
#include "kernels/fp8_cast.h"
#include "kernels/fused_tile.h"
#include "kernels/grouped_fp8_params.h"
#include "kernels/verified_devices.h"
#include "metrale/numerics.h"
#include "metrale/ops/grouped_fp8.h"
#include "support/fp8_reference.h"
#include "support/read_back.h"

namespace metrale::cuda::testing {
namespace {

namespace f8 = metrale::testing::fp8;
using metrale::testing::read;
using metrale::testing::upload;

constexpr std::uint32_t kCastTile = 8;
constexpr std::uint32_t kTile = 24;          // unlike the real kernel's 32
constexpr std::uint32_t kBlockThreads = 96;  // unlike the real kernel's 256
constexpr std::uint32_t kTiledTile = 40;     // unlike the real tiled kernel's 128
constexpr std::uint32_t kTiledMinM = 4;      // unlike the real tiled kernel's 16
constexpr std::uint16_t kPoison = 0xFFFF;

// The tiled entry the fake module has: none, a placeholder (a target without wgmma), one no
// device verified, or one a device verified.
enum class Tiled { kNone, kAbsent, kUnverified, kVerified };

// A fake gemm_grouped_e4m3_block128_tiled: persistent, block b walking tiles b, b + grid, ... of
// the layer as the real kernel does (fused_tile.h's slots of 128 rows, then the N tiles of the
// published width), each tile by the CPU's portable dense kernel; the tiles it was launched with
// and walked land in *walked.
FakeFunction tiled_gemm(std::vector<FakeLaunch>* launches, std::int64_t* walked) {
  FakeFunction f;
  f.param_sizes = {sizeof(GroupedFp8Params)};
  f.body = [launches, walked](const FakeLaunch& l) {
    FakeLaunch copy = l;
    copy.params = nullptr;
    launches->push_back(copy);
    const auto g = read_param<GroupedFp8Params>(l.params, 0);
    const int experts = fused::grouped_experts(g.experts);
    std::vector<int> first{0};
    for (int e = 0; e < experts; ++e) {
      std::int64_t r0 = 0, m = 0;
      const bool rows = grouped_fp8::expert_rows(g, e, &r0, &m);
      first.push_back(first.back() + (rows ? fused::grouped_slots(m, r0, g.rows) : 0));
    }
    const std::int64_t n_tiles = (g.n + kTiledTile - 1) / kTiledTile;
    const std::int64_t tiles = first.back() * n_tiles;
    for (std::int64_t b = 0; b < l.grid[0]; ++b) {
      for (std::int64_t t = b; t < tiles; t += l.grid[0], ++*walked) {
        const int slot = static_cast<int>(t / n_tiles);
        const int e = fused::grouped_expert_of([&first](int i) { return first[i]; }, experts, slot);
        std::int64_t r0 = 0, m = 0;
        grouped_fp8::expert_rows(g, e, &r0, &m);
        const std::int64_t m0 = std::int64_t{slot - first[static_cast<std::size_t>(e)]} * 128;
        DenseParams p;
        p.a = g.a + static_cast<std::uint64_t>((r0 + m0) * g.k);
        p.a_scales = g.a_scales + static_cast<std::uint64_t>((r0 + m0) * 4);
        p.a_scales_ld = fp8::scales_ld(g.rows);
        p.b = g.b + static_cast<std::uint64_t>(e) * g.b_stride;
        p.b_scales = g.b_scales + static_cast<std::uint64_t>(e) * g.b_scales_stride;
        p.c = g.c + static_cast<std::uint64_t>((r0 + m0) * g.n * 2);
        p.m = std::min<std::int64_t>(128, m - m0);
        p.n = g.n;
        p.k = g.k;
        const std::int64_t n0 = (t % n_tiles) * kTiledTile;
        cpu::blas::gemm_e4m3_block128(p, n0, std::min<std::int64_t>(g.n, n0 + kTiledTile));
      }
    }
  };
  return f;
}

ModuleSpec fp8_module(std::vector<FakeLaunch>* launches, Tiled tiled = Tiled::kNone,
                      std::int64_t* walked = nullptr) {
  ModuleSpec m;
  m.name = "fp8";
  FakeFunction cast;
  cast.param_sizes = {sizeof(Fp8CastParams)};
  cast.body = [launches](const FakeLaunch& l) {
    FakeLaunch copy = l;
    copy.params = nullptr;
    launches->push_back(copy);
    const auto p = read_param<Fp8CastParams>(l.params, 0);
    const std::int64_t pairs = p.m * ((p.k + fp8::kCastBlock - 1) / fp8::kCastBlock);
    for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
      const std::int64_t i0 = bx * kCastTile, i1 = std::min<std::int64_t>(pairs, i0 + kCastTile);
      if (i0 < i1) cpu::fp8::cast_e4m3_block128(p, i0, i1);
    }
  };
  FakeFunction gemm;
  gemm.param_sizes = {sizeof(GroupedFp8Params)};
  gemm.body = [launches](const FakeLaunch& l) {
    FakeLaunch copy = l;
    copy.params = nullptr;
    launches->push_back(copy);
    const auto g = read_param<GroupedFp8Params>(l.params, 0);
    for (std::int64_t by = 0; by < l.grid[1]; ++by) {
      std::int64_t first = 0, rows = 0;
      if (!grouped_fp8::expert_rows(g, by, &first, &rows)) continue;
      DenseParams p;
      p.a = g.a + static_cast<std::uint64_t>(first * g.k);
      p.a_scales = g.a_scales + static_cast<std::uint64_t>(first * 4);
      p.a_scales_ld = fp8::scales_ld(g.rows);
      p.b = g.b + static_cast<std::uint64_t>(by) * g.b_stride;
      p.b_scales = g.b_scales + static_cast<std::uint64_t>(by) * g.b_scales_stride;
      p.c = g.c + static_cast<std::uint64_t>(first * g.n * 2);
      p.m = rows;
      p.n = g.n;
      p.k = g.k;
      for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
        const std::int64_t n0 = bx * kTile, n1 = std::min<std::int64_t>(g.n, n0 + kTile);
        if (n0 < n1) cpu::blas::gemm_e4m3_block128(p, n0, n1);
      }
    }
  };
  m.fake.functions["cast_e4m3_block128"] = cast;
  m.fake.functions["gemm_grouped_e4m3_block128"] = gemm;
  m.fake.publish_u32("cast_e4m3_block128_n_tile", kCastTile)
      .publish_u32("cast_e4m3_block128_block_threads", 256)
      .publish_u32("gemm_grouped_e4m3_block128_n_tile", kTile)
      .publish_u32("gemm_grouped_e4m3_block128_block_threads", kBlockThreads);
  m.entries = {"cast_e4m3_block128", "gemm_grouped_e4m3_block128"};
  if (tiled == Tiled::kNone) return m;
  const std::string e = "gemm_grouped_e4m3_block128_tiled";
  m.entries.push_back(e);
  m.fake.functions[e] = tiled_gemm(launches, walked);
  if (tiled == Tiled::kAbsent) {
    m.fake.publish_u32(e + "_absent", 1);
    return m;
  }
  m.fake.publish_u32(e + "_n_tile", kTiledTile)
      .publish_u32(e + "_m_tile", 128)
      .publish_u32(e + "_block_threads", kBlockThreads)
      .publish_u32(e + "_smem_bytes", 100 * 1024)
      .publish_u32(e + "_persistent", 1)
      .publish_u32(e + "_blocks_per_sm", 1)
      .publish_u32(e + "_min_m", kTiledMinM);
  if (tiled == Tiled::kVerified) {
    m.fake.publish_u32(e + "_verified", 20261206)
        .publish_u32(e + "_verified_on", metrale::verified::kH200);
  }
  return m;
}

struct GroupedFp8Rig {
  explicit GroupedFp8Rig(Tiled tiled = Tiled::kNone) : rig(options(&launches, tiled, &walked)) {}
  static RigOptions options(std::vector<FakeLaunch>* launches, Tiled tiled, std::int64_t* walked) {
    RigOptions o;
    o.modules = {core_module(), fp8_module(launches, tiled, walked)};
    return o;
  }
  std::vector<FakeLaunch> launches;
  std::int64_t walked = 0;
  Rig rig;
};

// Every expert's rows of C (BF16 [rows, N]) against the cast-aware float64 reference of A
// (BF16 [rows, K]) times its weights, the other rows unwritten.
void expect_experts(const std::vector<std::uint16_t>& c, const std::vector<std::uint16_t>& a,
                    const std::vector<f8::HostFp8Weights>& host,
                    const std::vector<std::int32_t>& counts,
                    const std::vector<std::int32_t>& offsets) {
  const std::int64_t n = host[0].n, k = host[0].k;
  const double gamma = static_cast<double>(k + 2 * f8::blocks(k) + 8) * std::ldexp(1.0, -23);
  const double u8 = std::ldexp(1.0, -8);
  std::vector<bool> used(c.size() / static_cast<std::size_t>(n), false);
  for (std::size_t e = 0; e < counts.size(); ++e) {
    const std::vector<std::uint16_t> a_e(a.begin() + offsets[e] * k,
                                         a.begin() + (offsets[e] + counts[e]) * k);
    const f8::CastA a8 = f8::cast_a(a_e, counts[e], k);
    for (std::int64_t i = 0; i < counts[e]; ++i) {
      used[static_cast<std::size_t>(offsets[e] + i)] = true;
      for (std::int64_t j = 0; j < n; ++j) {
        double ref = 0, mag = 0;
        for (std::int64_t q = 0; q < k; ++q) {
          const double p = a8.value[static_cast<std::size_t>(i * k + q)] * host[e].at(j, q);
          ref += p;
          mag += std::fabs(p);
        }
        const std::uint16_t bits = c[static_cast<std::size_t>((offsets[e] + i) * n + j)];
        ASSERT_NE(bits, kPoison) << "expert " << e << " C[" << i << ", " << j << "] unwritten";
        ASSERT_LE(std::fabs(num::bf16_to_f32(bits) - ref),
                  u8 * std::fabs(ref) + (1 + u8) * gamma * mag)
            << "expert " << e << " C[" << i << ", " << j << "]";
      }
    }
  }
  for (std::size_t i = 0; i < c.size(); ++i) {
    if (used[i / static_cast<std::size_t>(n)]) continue;
    ASSERT_EQ(c[i], kPoison) << "row " << i / static_cast<std::size_t>(n)
                             << " of no expert was written";
  }
}

// One run of a plan: A drawn (BF16 [rows, K]), C poisoned, and both read back; what it
// allocated freed.
struct Ran {
  std::vector<std::uint16_t> a, c;
};
Ran run_once(CudaBackend& b, const ops::GroupedFp8Plan& plan, const ops::GroupedFp8Weights& w,
             const std::vector<std::int32_t>& counts, const std::vector<std::int32_t>& offsets,
             std::mt19937_64& gen) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Ran r;
  r.a.resize(static_cast<std::size_t>(plan.rows * plan.k));
  for (auto& x : r.a) x = num::f32_to_bf16(u(gen));
  const auto c_elems = static_cast<std::size_t>(plan.rows * plan.n);
  const DevicePtr da = upload(b, r.a), dc = b.alloc(c_elems * 2);
  b.memset(dc, 0xFF, c_elems * 2);
  const DevicePtr dcounts = upload(b, counts), doffsets = upload(b, offsets);
  ops::run_grouped(plan, b.default_stream(), da, w, dcounts, doffsets, dc,
                   ops::scratch_workspace(plan, b.default_stream()));
  b.synchronize(b.default_stream());
  r.c = read<std::uint16_t>(b, dc, c_elems);
  for (DevicePtr p : {da, dc, dcounts, doffsets}) b.free(p);
  return r;
}

TEST(GroupedFp8Launch, RefusedUnlessOptedInThenACastAndOneLaunchOverEveryExpert) {
  std::mt19937_64 gen{std::random_device{}()};
  GroupedFp8Rig r;
  CudaBackend& b = r.rig.b();
  constexpr std::int64_t kN = 56, kK = 272, kRows = 12;
  const std::vector<std::int32_t> counts = {3, 0, 6, 1}, offsets = {0, 3, 3, 9, 10};
  std::vector<f8::HostFp8Weights> host;
  std::vector<E4m3BlockWeightsView> views;
  for (int e = 0; e < 4; ++e) host.push_back(f8::random_weights(kN, kK, gen));
  for (const auto& h : host) views.push_back({h.n, h.k, h.codes, h.scales});
  ops::GroupedFp8WeightsResource res(b, views);
  EXPECT_ERROR(ops::plan_grouped(b, kRows, res.weights()), ErrorCode::kUnavailable,
               "set GroupedFp8Options::allow_unverified");
  ops::GroupedFp8Options opt;
  opt.allow_unverified = true;
  const ops::GroupedFp8Plan plan = ops::plan_grouped(b, kRows, res.weights(), opt);
  const Ran ran = run_once(b, plan, res.weights(), counts, offsets, gen);
  ASSERT_EQ(r.launches.size(), 2u);
  EXPECT_EQ(r.launches[0].grid[0], (kRows * 3 + kCastTile - 1) / kCastTile);  // every row cast
  EXPECT_EQ(r.launches[1].grid[0], (kN + kTile - 1) / kTile);
  EXPECT_EQ(r.launches[1].grid[1], 4u);
  EXPECT_EQ(r.launches[1].block[0], kBlockThreads);
  expect_experts(ran.c, ran.a, host, counts, offsets);
  res.release(b);
}

// The CPU's panel layout of FP8 experts on a backend whose grouped kernel publishes no `panels`:
// asked for, the upload is refused by name (nothing left allocated); preferred, the upload keeps
// row-major codes; weights described as panels by hand are refused by the plan.
TEST(GroupedFp8Launch, ThePanelLayoutIsRefusedWhereTheKernelDoesNotReadIt) {
  std::mt19937_64 gen{std::random_device{}()};
  GroupedFp8Rig r;
  CudaBackend& b = r.rig.b();
  const f8::HostFp8Weights h = f8::random_weights(64, 144, gen);
  const std::vector<E4m3BlockWeightsView> views = {{h.n, h.k, h.codes, h.scales}};
  EXPECT_FALSE(ops::reads_fp8_panel_layout(b));
  EXPECT_ERROR(ops::GroupedFp8WeightsResource(b, views, "x", ops::UploadLayout::kPanels),
               ErrorCode::kUnavailable, "does not read the panel layout");
  EXPECT_EQ(b.live_alloc_count(), 0u);
  ops::GroupedFp8WeightsResource res(b, views, "x", ops::UploadLayout::kBackendPreferred);
  EXPECT_EQ(res.weights().packing, ops::WeightPacking::kSource);
  ops::GroupedFp8Weights panels = res.weights();  // 64 columns: the same bytes either way
  panels.packing = ops::WeightPacking::kPanels;
  ops::GroupedFp8Options opt;
  opt.allow_unverified = true;
  EXPECT_ERROR(ops::plan_grouped(b, 4, panels, opt), ErrorCode::kUnavailable,
               "does not read experts in the panel layout");
  res.release(b);
}

// The tiled route on a module that has it, not yet verified: refused unless the caller opts in;
// opted in, one cast and one persistent launch of min(the most tiles the row capacity can make,
// a wave) blocks of the published size and shared memory, whose blocks walk every expert's tiles
// (slots of 128 rows x N tiles of the published width) once: experts of 130 and 300 rows, an
// empty one, one of 6, each against the cast-aware float64 reference.
TEST(GroupedFp8Launch, TheTiledRouteIsOneWaveWalkingEveryExpertsTiles) {
  std::mt19937_64 gen{std::random_device{}()};
  GroupedFp8Rig r(Tiled::kUnverified);
  CudaBackend& b = r.rig.b();
  constexpr std::int64_t kN = 56, kK = 272;
  const std::vector<std::int32_t> counts = {130, 0, 6, 300}, offsets = {0, 130, 130, 136, 436};
  const std::int64_t rows = 440;
  std::vector<f8::HostFp8Weights> host;
  std::vector<E4m3BlockWeightsView> views;
  for (int e = 0; e < 4; ++e) host.push_back(f8::random_weights(kN, kK, gen));
  for (const auto& h : host) views.push_back({h.n, h.k, h.codes, h.scales});
  ops::GroupedFp8WeightsResource res(b, views);
  ops::GroupedFp8Options opt;
  opt.route = ops::GemmRoute::kTiled;
  EXPECT_ERROR(ops::plan_grouped(b, rows, res.weights(), opt), ErrorCode::kUnavailable,
               "is not yet run on a GPU; set GroupedFp8Options::allow_unverified");
  opt.allow_unverified = true;
  const ops::GroupedFp8Plan plan = ops::plan_grouped(b, rows, res.weights(), opt);
  EXPECT_EQ(plan.route, ops::GemmRoute::kTiled);
  // At most rows / 128 + min(experts, rows) slots: 3 + 4 = 7, times 2 N tiles, under a wave.
  const std::uint32_t most = static_cast<std::uint32_t>(fused::grouped_max_slots(rows, 4)) * 2;
  EXPECT_EQ(plan.gemm.grid.x, most) << plan.describe();
  EXPECT_NE(plan.describe().find("gemm_grouped_e4m3_block128_tiled"), std::string::npos)
      << plan.describe();
  const Ran ran = run_once(b, plan, res.weights(), counts, offsets, gen);
  ASSERT_EQ(r.launches.size(), 2u);
  EXPECT_EQ(r.launches[1].grid[0], most);
  EXPECT_EQ(r.launches[1].grid[1], 1u);
  EXPECT_EQ(r.launches[1].block[0], kBlockThreads);
  EXPECT_EQ(r.launches[1].shared_bytes, 100u * 1024);
  EXPECT_EQ(r.walked, (2 + 0 + 1 + 3) * 2) << "each expert's slots times the N tiles, once";
  expect_experts(ran.c, ran.a, host, counts, offsets);
  // A capacity whose tiles pass a wave (132 SMs x 1 block): one wave.
  const ops::GroupedFp8Plan big = ops::plan_grouped(b, 100000, res.weights(), opt);
  EXPECT_EQ(big.gemm.grid.x, 132u) << big.describe();
  res.release(b);
}

// kAuto takes the tiled kernel only where a device verified it and the rows per expert on
// average reach its _min_m; kDecode and kTiled are taken as asked; a placeholder tiled entry is
// refused by name when asked for and never chosen; a module without it refuses kTiled by name
// (kUnavailable); a route the op does not have is refused by name.
TEST(GroupedFp8Launch, TheRouteIsChosenAsPublishedAndAskedFor) {
  std::mt19937_64 gen{std::random_device{}()};
  const f8::HostFp8Weights h = f8::random_weights(64, 144, gen);
  const std::vector<E4m3BlockWeightsView> views(8, {h.n, h.k, h.codes, h.scales});
  const auto route = [&views](Tiled tiled, std::int64_t rows, ops::GemmRoute asked) {
    GroupedFp8Rig r(tiled);
    ops::GroupedFp8WeightsResource res(r.rig.b(), views);
    ops::GroupedFp8Options opt;
    opt.allow_unverified = true;
    opt.route = asked;
    ops::GroupedFp8Plan p;
    try {
      p = ops::plan_grouped(r.rig.b(), rows, res.weights(), opt);
    } catch (...) {
      res.release(r.rig.b());
      throw;
    }
    EXPECT_NE(
        p.describe().find(p.route == ops::GemmRoute::kTiled ? "gemm_grouped_e4m3_block128_tiled"
                                                            : "gemm_grouped_e4m3_block128 "),
        std::string::npos)
        << p.describe();
    res.release(r.rig.b());
    return p.route;
  };
  using ops::GemmRoute;
  EXPECT_EQ(route(Tiled::kVerified, 8 * kTiledMinM, GemmRoute::kAuto), GemmRoute::kTiled);
  EXPECT_EQ(route(Tiled::kVerified, 8 * kTiledMinM - 1, GemmRoute::kAuto), GemmRoute::kDecode);
  EXPECT_EQ(route(Tiled::kVerified, 1000, GemmRoute::kDecode), GemmRoute::kDecode);
  EXPECT_EQ(route(Tiled::kUnverified, 1000, GemmRoute::kAuto), GemmRoute::kDecode);
  EXPECT_EQ(route(Tiled::kUnverified, 1, GemmRoute::kTiled), GemmRoute::kTiled);
  EXPECT_EQ(route(Tiled::kAbsent, 1000, GemmRoute::kAuto), GemmRoute::kDecode);
  EXPECT_EQ(route(Tiled::kNone, 1000, GemmRoute::kAuto), GemmRoute::kDecode);
  EXPECT_ERROR(route(Tiled::kAbsent, 1000, GemmRoute::kTiled), ErrorCode::kUnavailable,
               "gemm_grouped_e4m3_block128_tiled is a placeholder on this target");
  EXPECT_ERROR(route(Tiled::kNone, 1000, GemmRoute::kTiled), ErrorCode::kUnavailable,
               "has no kernel fp8::gemm_grouped_e4m3_block128_tiled (the tiled route is CUDA's");
  EXPECT_ERROR(route(Tiled::kVerified, 1000, GemmRoute::kFused), ErrorCode::kInvalidArgument,
               "route fused is not a grouped W8A8 route (kAuto, kDecode or kTiled)");
}

}  // namespace
}  // namespace metrale::cuda::testing
