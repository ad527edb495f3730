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
#include "kernels/grouped_fp8_params.h"
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
constexpr std::uint16_t kPoison = 0xFFFF;

ModuleSpec fp8_module(std::vector<FakeLaunch>* launches) {
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
  return m;
}

struct GroupedFp8Rig {
  GroupedFp8Rig() : rig(options(&launches)) {}
  static RigOptions options(std::vector<FakeLaunch>* launches) {
    RigOptions o;
    o.modules = {core_module(), fp8_module(launches)};
    return o;
  }
  std::vector<FakeLaunch> launches;
  Rig rig;
};

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
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> a(kRows * kK);
  for (auto& x : a) x = num::f32_to_bf16(u(gen));
  const DevicePtr da = upload(b, a), dc = b.alloc(kRows * kN * 2);
  b.memset(dc, 0xFF, kRows * kN * 2);
  const DevicePtr dcounts = upload(b, counts), doffsets = upload(b, offsets);
  ops::run_grouped(plan, b.default_stream(), da, res.weights(), dcounts, doffsets, dc,
                   ops::scratch_workspace(plan, b.default_stream()));
  b.synchronize(b.default_stream());
  ASSERT_EQ(r.launches.size(), 2u);
  EXPECT_EQ(r.launches[0].grid[0], (kRows * 3 + kCastTile - 1) / kCastTile);  // every row cast
  EXPECT_EQ(r.launches[1].grid[0], (kN + kTile - 1) / kTile);
  EXPECT_EQ(r.launches[1].grid[1], 4u);
  EXPECT_EQ(r.launches[1].block[0], kBlockThreads);
  const auto c = read<std::uint16_t>(b, dc, kRows * kN);
  const double gamma = static_cast<double>(kK + 2 * f8::blocks(kK) + 8) * std::ldexp(1.0, -23);
  const double u8 = std::ldexp(1.0, -8);
  for (int e = 0; e < 4; ++e) {
    const std::vector<std::uint16_t> a_e(a.begin() + offsets[e] * kK,
                                         a.begin() + (offsets[e] + counts[e]) * kK);
    const f8::CastA a8 = f8::cast_a(a_e, counts[e], kK);
    for (std::int64_t i = 0; i < counts[e]; ++i) {
      for (std::int64_t j = 0; j < kN; ++j) {
        double ref = 0, mag = 0;
        for (std::int64_t q = 0; q < kK; ++q) {
          const double p = a8.value[static_cast<std::size_t>(i * kK + q)] * host[e].at(j, q);
          ref += p;
          mag += std::fabs(p);
        }
        const std::uint16_t bits = c[static_cast<std::size_t>((offsets[e] + i) * kN + j)];
        ASSERT_NE(bits, kPoison) << "expert " << e << " C[" << i << ", " << j << "] unwritten";
        ASSERT_LE(std::fabs(num::bf16_to_f32(bits) - ref),
                  u8 * std::fabs(ref) + (1 + u8) * gamma * mag)
            << "expert " << e << " C[" << i << ", " << j << "]";
      }
    }
  }
  for (std::size_t i = 10 * kN; i < c.size(); ++i) {
    ASSERT_EQ(c[i], kPoison) << "row " << i / kN << " of no expert was written";
  }
  for (DevicePtr p : {da, dc, dcounts, doffsets}) b.free(p);
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

}  // namespace
}  // namespace metrale::cuda::testing
