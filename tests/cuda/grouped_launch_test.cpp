// The grouped GEMM (ops/grouped_gemm.h) on the CUDA backend over the fake driver: a fake w4a16
// module whose gemm_grouped computes only the blocks it is launched with (block x its N tile of
// the published width, block y its expert, the expert's rows and weights found by
// grouped::expert_params from the device's counts and offsets) from the source layout's bytes.
// Checked: no device run has verified it, so the plan refuses it unless the caller opts in; opted
// in, the launch is (ceil(N / tile), experts) and every expert's rows match the float64 reference
// of its own weights and tensor scale, rows of no expert untouched.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cuda/fake_gemm.h"
#include "cuda/rig.h"
#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "metrale/numerics.h"
#include "metrale/ops/grouped_gemm.h"
#include "ops/gemm_reference.h"
#include "ops/int4_cases.h"
#include "reliability/fake_model.h"
#include "support/read_back.h"

namespace metrale::cuda::testing {
namespace {

namespace ref = metrale::testing::gemm;
namespace rel = metrale::testing::reliability;
using metrale::testing::read;
using metrale::testing::upload;

constexpr std::uint32_t kTile = 24;          // unlike the real kernel's 32
constexpr std::uint32_t kBlockThreads = 96;  // unlike the real kernels' 256

// NVFP4 W[n, k] in the source layout, row-major, from the buffers p points at.
float nvfp4_weight(const GemmParams& p, std::int64_t n, std::int64_t k) {
  const std::uint8_t byte = at<const std::uint8_t>(p.codes)[n * (p.k / 2) + k / 2];
  const auto code = static_cast<std::uint8_t>((k & 1) ? byte >> 4 : byte & 0xF);
  const std::uint8_t s = at<const std::uint8_t>(p.scales)[n * (p.k / 16) + k / 16];
  return num::e2m1_to_f32(code) * num::e4m3_to_f32(s);
}

constexpr std::uint32_t kSplitUnit = 64;   // K per split unit, unlike the real kernels' 1024
constexpr std::uint32_t kReduceTile = 16;  // columns a reduction block, unlike the real 256

FakeFunction recorded(std::vector<FakeLaunch>* launches, std::function<void(const FakeLaunch&)> f) {
  FakeFunction g;
  g.param_sizes = {sizeof(GroupedGemmParams)};
  g.body = [launches, f = std::move(f)](const FakeLaunch& l) {
    FakeLaunch copy = l;
    copy.params = nullptr;
    launches->push_back(copy);
    f(l);
  };
  return g;
}

// Every expert's rows of C (BF16, N columns) against the float64 reference of its own weights on
// its rows of A (K columns) and its bias row where given, under the route's tolerance; experts
// without rows are skipped.
void expect_experts_close(const std::vector<std::uint16_t>& c, const std::vector<std::uint16_t>& a,
                          const std::vector<HostQuantWeights>& host,
                          const std::vector<std::int32_t>& counts,
                          const std::vector<std::int32_t>& offsets, std::int64_t n, std::int64_t k,
                          ops::GemmRoute route, WeightFormat format,
                          const std::vector<std::uint16_t>& bias = {}) {
  const auto tol = toolkit::gemm_tolerance(route, format);
  for (std::size_t e = 0; e < host.size(); ++e) {
    if (counts[e] == 0) continue;
    SCOPED_TRACE(fmt::format("expert {}", e));
    const auto rows = static_cast<std::size_t>(counts[e]),
               first = static_cast<std::size_t>(offsets[e]);
    const auto un = static_cast<std::size_t>(n), uk = static_cast<std::size_t>(k);
    const std::span<const std::uint16_t> a_e(a.data() + first * uk, rows * uk);
    const std::span<const std::uint16_t> bias_e =
        bias.empty() ? std::span<const std::uint16_t>{}
                     : std::span<const std::uint16_t>(bias.data() + e * un, un);
    const auto reference = toolkit::reference(a_e, counts[e], host[e], bias_e, tol);
    ref::expect_close(
        toolkit::compare(std::span<const std::uint16_t>(c.data() + first * un, rows * un),
                         reference),
        tol.normalized, "against float64");
  }
}

// gemm_grouped as kernels/grouped_params.h says the grouped kernels work: block (x, y, z) takes
// columns of tile x of expert y's rows over K slice z (tile_math.h's split_k_range), writing C
// or, with K split, FP32 partials at (z · rows_e + row) · N + n of the expert's workspace, which
// expert_params places. gemm_grouped_split_reduce: block (x, y) sums kReduceTile columns of
// expert y's rows over its slices, in order, into C.
ModuleSpec grouped_module(std::vector<FakeLaunch>* launches, bool split = false) {
  ModuleSpec m;
  m.name = "w4a16";
  m.fake.functions["gemm_decode"] = fake_split_decode(kTile, nvfp4_weight);
  m.fake.functions["gemm_grouped"] = recorded(launches, [](const FakeLaunch& l) {
    const auto gp = read_param<GroupedGemmParams>(l.params, 0);
    for (std::int64_t z = 0; z < l.grid[2]; ++z) {
      for (std::int64_t by = 0; by < l.grid[1]; ++by) {
        GemmParams p;
        if (!grouped::expert_params(gp, by, &p)) continue;
        for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
          fake_split_decode_block(p, z, bx * kTile, (bx + 1) * kTile, nvfp4_weight);
        }
      }
    }
  });
  m.fake.functions["gemm_grouped_split_reduce"] = recorded(launches, [](const FakeLaunch& l) {
    const auto gp = read_param<GroupedGemmParams>(l.params, 0);
    for (std::int64_t by = 0; by < l.grid[1]; ++by) {
      GemmParams p;
      if (!grouped::expert_params(gp, by, &p)) continue;
      for (std::int64_t n = 0; n < std::int64_t{l.grid[0]} * kReduceTile && n < p.n; ++n) {
        for (std::int64_t row = 0; row < p.m; ++row) {
          float sum = 0.0f;
          for (std::int64_t z = 0; z < p.splits; ++z) {
            sum += at<const float>(p.workspace)[(z * p.m + row) * p.n + n];
          }
          store_c(p, row, n, sum);
        }
      }
    }
  });
  m.fake.publish_u32("gemm_decode_n_tile", kTile).publish_u32("gemm_decode_max_m", 16);
  m.fake.publish_u32("gemm_grouped_n_tile", kTile);
  m.fake.publish_u32("gemm_grouped_split_reduce_n_tile", kReduceTile);
  if (split) {
    m.fake.publish_u32("gemm_grouped_split_k", kSplitUnit);
    m.fake.publish_u32("gemm_grouped_blocks_per_sm", 1);
  }
  m.entries = {"gemm_decode", "gemm_grouped", "gemm_grouped_split_reduce"};
  for (const std::string& e : m.entries) m.fake.publish_u32(e + "_block_threads", kBlockThreads);
  return m;
}

struct GroupedRig {
  explicit GroupedRig(bool split = false) : rig(options(&launches, split)) {}
  static RigOptions options(std::vector<FakeLaunch>* launches, bool split) {
    RigOptions o;
    o.modules = {core_module(), grouped_module(launches, split)};
    return o;
  }
  std::vector<FakeLaunch> launches;
  Rig rig;
};

TEST(GroupedLaunch, RefusedUnlessOptedInThenOneLaunchOverEveryExpert) {
  std::mt19937_64 gen{std::random_device{}()};
  GroupedRig r;
  CudaBackend& b = r.rig.b();
  constexpr std::int64_t kN = 56, kK = 64, kRows = 12;
  const std::vector<std::int32_t> counts = {3, 0, 6, 1}, offsets = {0, 3, 3, 9, 10};
  std::vector<HostQuantWeights> host;
  for (int e = 0; e < 4; ++e) {
    host.push_back(
        ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, kN, kK), kN, kK));
    host.back().tensor_scale = 0.5f * static_cast<float>(e + 1);
  }
  ops::GroupedWeightsResource res(b, host);
  EXPECT_ERROR(ops::plan_grouped(b, kRows, res.weights()), ErrorCode::kUnavailable,
               "not yet run on a GPU; set GroupedGemmOptions::allow_unverified");
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = true;
  const ops::GroupedGemmPlan plan = ops::plan_grouped(b, kRows, res.weights(), opt);
  const auto a = ref::random_activations(gen, kRows * kK);
  const DevicePtr da = upload(b, a), dc = b.alloc(kRows * kN * 2);
  b.memset(dc, ref::kPoisonByte, kRows * kN * 2);
  const DevicePtr dcounts = upload(b, counts), doffsets = upload(b, offsets);
  ops::run_grouped(plan, b.default_stream(), da, res.weights(), dcounts, doffsets, dc, {});
  b.synchronize(b.default_stream());
  ASSERT_EQ(r.launches.size(), 1u);
  EXPECT_EQ(r.launches[0].grid[0], (kN + kTile - 1) / kTile);
  EXPECT_EQ(r.launches[0].grid[1], 4u);
  EXPECT_EQ(r.launches[0].block[0], kBlockThreads);
  const auto c = read<std::uint16_t>(b, dc, kRows * kN);
  expect_experts_close(c, a, host, counts, offsets, kN, kK, ops::GemmRoute::kDecode,
                       WeightFormat::kNvfp4);
  for (std::size_t i = 10 * kN; i < c.size(); ++i) {
    ASSERT_EQ(c[i], ref::kPoisonBf16) << "row " << i / kN << " of no expert was written";
  }
  for (DevicePtr p : {da, dc, dcounts, doffsets}) b.free(p);
  res.release(b);
}

// Split-K on the decode route, where the kernel publishes a split unit: 4 experts of N = 56 make
// 3 column tiles each, at most 12 blocks with rows on a device of 132 SMs, so K = 608 is cut into
// slices of the unit (9 x 64 and a short 32) over grid z; each slice's partials go to the
// workspace beside its expert's rows and gemm_grouped_split_reduce sums them into C. Every
// expert's rows against float64 with bias, rows of no expert untouched; the workspace the plan
// asks for checked (missing, short, overlapping C) and an edited split refused, nothing queued.
TEST(GroupedLaunch, SplitKSlicesEachExpertThenOneReductionSumsThem) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  GroupedRig r(true);
  CudaBackend& b = r.rig.b();
  constexpr std::int64_t kN = 56, kK = 608, kRows = 12;
  const std::vector<std::int32_t> counts = {3, 0, 6, 1}, offsets = {0, 3, 3, 9, 10};
  std::vector<HostQuantWeights> host;
  for (int e = 0; e < 4; ++e) {
    host.push_back(
        ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, kN, kK), kN, kK));
    host.back().tensor_scale = 0.5f * static_cast<float>(e + 1);
  }
  ops::GroupedWeightsResource res(b, host);
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = true;
  opt.bias = true;
  const ops::GroupedGemmPlan plan = ops::plan_grouped(b, kRows, res.weights(), opt);
  EXPECT_EQ(plan.launch.grid, (Dim3{3, 4, 10})) << plan.describe();
  EXPECT_EQ(plan.splits, 10);
  EXPECT_EQ(plan.k_per_split, 64);
  EXPECT_EQ(plan.workspace_bytes, 10u * kRows * kN * 4);
  EXPECT_EQ(plan.reduce.grid, (Dim3{4, 4, 1})) << plan.describe();
  const auto a = ref::random_activations(gen, kRows * kK);
  std::vector<std::uint16_t> bias;
  for (int e = 0; e < 4; ++e) {
    const auto row = ref::random_bias(gen, kN);
    bias.insert(bias.end(), row.begin(), row.end());
  }
  const DevicePtr da = upload(b, a), db = upload(b, bias), dc = b.alloc(kRows * kN * 2);
  b.memset(dc, ref::kPoisonByte, kRows * kN * 2);
  const DevicePtr dcounts = upload(b, counts), doffsets = upload(b, offsets);
  const DevicePtr short_ws = b.alloc(plan.workspace_bytes - 4);
  // The workspace as planned and a tail, all NaN until written.
  constexpr std::size_t kTail = 64;
  const std::size_t partials = plan.workspace_bytes / 4;
  const DevicePtr dws =
      upload(b, std::vector<float>(partials + kTail, std::numeric_limits<float>::quiet_NaN()));
  const auto go = [&](const ops::GroupedGemmPlan& p, const ops::GroupedGemmWorkspace& w) {
    ops::run_grouped(p, b.default_stream(), da, res.weights(), dcounts, doffsets, dc, w, db);
  };
  EXPECT_ERROR(go(plan, {}), ErrorCode::kInvalidArgument, "split-K workspace is null");
  EXPECT_ERROR(go(plan, {short_ws}), ErrorCode::kInvalidArgument, "split-K workspace");
  for (const DevicePtr other : {dc, da, dcounts}) {
    EXPECT_ERROR(go(plan, {other}), ErrorCode::kInvalidArgument, "split-K workspace");
  }
  ops::GroupedGemmPlan edited = plan;
  edited.k_per_split = 32;  // slices of half the unit: 10 of them would leave K unsummed
  EXPECT_ERROR(go(edited, {dws}), ErrorCode::kInvalidArgument, "the plan's split of K");
  edited = plan;
  edited.workspace_bytes /= 2;
  EXPECT_ERROR(go(edited, {dws}), ErrorCode::kInvalidArgument, "the plan's split of K");
  edited = plan;
  edited.reduce.grid.x = 1;  // the reduction over the first 16 columns only
  EXPECT_ERROR(go(edited, {dws}), ErrorCode::kInvalidArgument, "the plan's split of K");
  edited = plan;
  edited.reduce.kernel = plan.launch.kernel;
  EXPECT_ERROR(go(edited, {dws}), ErrorCode::kInvalidArgument, "the plan's split of K");
  EXPECT_TRUE(r.launches.empty()) << "a refused call queued work";
  go(plan, {dws});
  b.synchronize(b.default_stream());
  // Rows 10 and 11 belong to no expert: their partials (from row 10 x 10 slices on) and the tail
  // stay NaN.
  const auto ws = read<float>(b, dws, partials + kTail);
  for (std::size_t i = 10 * 10 * kN; i < ws.size(); ++i) {
    ASSERT_TRUE(std::isnan(ws[i])) << "partial " << i << " of no expert was written";
  }
  ASSERT_EQ(r.launches.size(), 2u);
  EXPECT_EQ(r.launches[0].grid[2], 10u);
  EXPECT_EQ(r.launches[1].grid[0], 4u);
  EXPECT_EQ(r.launches[1].grid[1], 4u);
  const auto c = read<std::uint16_t>(b, dc, kRows * kN);
  expect_experts_close(c, a, host, counts, offsets, kN, kK, ops::GemmRoute::kDecode,
                       WeightFormat::kNvfp4, bias);
  for (std::size_t i = 10 * kN; i < c.size(); ++i) {
    ASSERT_EQ(c[i], ref::kPoisonBf16) << "row " << i / kN << " of no expert was written";
  }
  for (DevicePtr p : {da, db, dc, dcounts, doffsets, short_ws, dws}) b.free(p);
  res.release(b);
}

// The masked layout's capacity (16 experts x 4 rows) bounds nothing: every expert could have rows,
// 3 x 16 blocks, and K is cut in 5. Told a routing gives 2 rows in all (one token, top 2),
// the plan counts 3 x 2 blocks and cuts K in all 10 of its units. A hint only: a routing of 3
// experts under that plan is exact. Outside [0, rows] it is refused.
TEST(GroupedLaunch, RoutedRowsBoundTheExpertsOfTheMaskedLayoutForSplitK) {
  std::mt19937_64 gen{std::random_device{}()};
  GroupedRig r(true);
  CudaBackend& b = r.rig.b();
  constexpr std::int64_t kN = 56, kK = 608, kCapacity = 4, kExperts = 16;
  constexpr std::int64_t kRows = kExperts * kCapacity;
  std::vector<HostQuantWeights> host;
  for (int e = 0; e < kExperts; ++e) {
    host.push_back(
        ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, kN, kK), kN, kK));
  }
  ops::GroupedWeightsResource res(b, host);
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = true;
  EXPECT_EQ(ops::plan_grouped(b, kRows, res.weights(), opt).splits, 5);
  opt.routed_rows = 2;
  const ops::GroupedGemmPlan plan = ops::plan_grouped(b, kRows, res.weights(), opt);
  EXPECT_EQ(plan.splits, 10) << plan.describe();
  for (const std::int64_t bad : {std::int64_t{-1}, kRows + 1}) {
    ops::GroupedGemmOptions o = opt;
    o.routed_rows = bad;
    EXPECT_ERROR(ops::plan_grouped(b, kRows, res.weights(), o), ErrorCode::kInvalidArgument,
                 fmt::format("routed_rows = {} is outside [0, rows = {}]", bad, kRows));
  }
  // Experts 1, 7 and 12 with 1, 4 and 2 rows of their slots; the rest empty.
  std::vector<std::int32_t> counts(kExperts, 0), offsets(kExperts + 1);
  counts[1] = 1;
  counts[7] = 4;
  counts[12] = 2;
  for (int e = 0; e <= kExperts; ++e) offsets[e] = static_cast<std::int32_t>(e * kCapacity);
  const auto a = ref::random_activations(gen, kRows * kK);
  const DevicePtr da = upload(b, a), dc = b.alloc(kRows * kN * 2);
  b.memset(dc, ref::kPoisonByte, kRows * kN * 2);
  const DevicePtr dcounts = upload(b, counts), doffsets = upload(b, offsets);
  const DevicePtr dws = b.alloc(plan.workspace_bytes);
  ops::run_grouped(plan, b.default_stream(), da, res.weights(), dcounts, doffsets, dc, {dws});
  b.synchronize(b.default_stream());
  const auto c = read<std::uint16_t>(b, dc, kRows * kN);
  expect_experts_close(c, a, host, counts, offsets, kN, kK, ops::GemmRoute::kDecode,
                       WeightFormat::kNvfp4);
  for (int e = 0; e < kExperts; ++e) {
    const auto at = static_cast<std::size_t>(offsets[e] * kN);
    for (std::int64_t i = counts[e] * kN; i < kCapacity * kN; ++i) {
      ASSERT_EQ(c[at + static_cast<std::size_t>(i)], ref::kPoisonBf16)
          << "a spare row of expert " << e << " written";
    }
  }
  for (DevicePtr p : {da, dc, dcounts, doffsets, dws}) b.free(p);
  res.release(b);
}

// Where the experts' blocks fill the waves, no split and no workspace: 4 experts of N = 792 make
// 33 tiles each, 132 blocks on 132 SMs. Its one slice is all of K = 608, off the split unit (the
// run checks the plan it is given: the unit's round-up of K was refused).
TEST(GroupedLaunch, FullWavesRunUnsplitWithOneSliceOfAllOfK) {
  std::mt19937_64 gen{std::random_device{}()};
  GroupedRig r(true);
  CudaBackend& b = r.rig.b();
  constexpr std::int64_t kN = 792, kK = 608, kRows = 4;
  const std::vector<std::int32_t> counts = {1, 1, 1, 1}, offsets = {0, 1, 2, 3, 4};
  std::vector<HostQuantWeights> host;
  for (int e = 0; e < 4; ++e) {
    host.push_back(
        ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, kN, kK), kN, kK));
  }
  ops::GroupedWeightsResource res(b, host);
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = true;
  const ops::GroupedGemmPlan plan = ops::plan_grouped(b, kRows, res.weights(), opt);
  EXPECT_EQ(plan.splits, 1) << plan.describe();
  EXPECT_EQ(plan.k_per_split, kK);
  EXPECT_EQ(plan.workspace_bytes, 0u);
  const auto a = ref::random_activations(gen, kRows * kK);
  const DevicePtr da = upload(b, a), dc = b.alloc(kRows * kN * 2);
  const DevicePtr dcounts = upload(b, counts), doffsets = upload(b, offsets);
  ops::run_grouped(plan, b.default_stream(), da, res.weights(), dcounts, doffsets, dc,
                   ops::scratch_workspace(plan, b.default_stream()));
  b.synchronize(b.default_stream());
  ASSERT_EQ(r.launches.size(), 1u);
  const auto c = read<std::uint16_t>(b, dc, kRows * kN);
  expect_experts_close(c, a, host, counts, offsets, kN, kK, ops::GemmRoute::kDecode,
                       WeightFormat::kNvfp4);
  for (DevicePtr p : {da, dc, dcounts, doffsets}) b.free(p);
  res.release(b);
}

// The fused route (gemm_grouped_fused, persistent) on the fake model (reliability/fake_model.h:
// slots of 24 rows, tiles 8 columns wide, each computed by the decode-layout twin): one launch of
// one wave whatever the routing, or of the tiles the capacity can make where fewer; every
// expert's rows against float64, with bias, rows of no expert untouched. Routing: 0, 1, 24 (one
// whole slot), 50 (two whole and a partial) and 9 rows, spare rows after them. NVFP4 experts
// take gemm_grouped_fused; INT4 experts in the INT4 decode layout gemm_grouped_int4_fused (its
// fake: the INT4 decode twin).
void expect_fused_route(WeightFormat format) {
  SCOPED_TRACE(to_string(format));
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  rel::FakeProcess proc;
  std::unique_ptr<Backend> b = proc.make_backend();
  ASSERT_EQ(b->sm_count(), 132u);
  constexpr std::int64_t kN = 40, kK = 64, kRows = 90;
  const std::vector<std::int32_t> counts = {0, 1, 24, 50, 9}, offsets = {0, 0, 1, 25, 75, 84};
  const bool int4 = format == WeightFormat::kInt4;
  std::vector<HostQuantWeights> host;
  for (int e = 0; e < 5; ++e) {
    if (int4) {
      ref::Int4Case c;
      c.n = kN;
      c.k = kK;
      c.group = 32;
      c.zero_points = true;
      c.fp16 = true;  // one scale format a layer (GroupedWeightsResource)
      host.push_back(ref::random_int4(gen, c));
      continue;
    }
    host.push_back(ref::quantize(format, ref::random_weight_values(gen, kN, kK), kN, kK));
    host.back().tensor_scale = 0.25f * static_cast<float>(e + 1);
  }
  ops::GroupedWeightsResource res(*b, host, "experts", ops::UploadLayout::kDecode);
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = true;
  opt.bias = true;
  // kAuto keeps the decode kernel: the fake's fused kernel, as the real one, is unverified.
  EXPECT_EQ(ops::plan_grouped(*b, kRows, res.weights(), opt).route, ops::GemmRoute::kDecode);
  opt.route = ops::GemmRoute::kFused;
  const ops::GroupedGemmPlan plan = ops::plan_grouped(*b, kRows, res.weights(), opt);
  EXPECT_EQ(plan.route, ops::GemmRoute::kFused);
  // At most 90 / 24 + 5 = 8 slots x 5 column tiles: 40 blocks, fewer than the wave of 132.
  EXPECT_EQ(plan.launch.grid, (Dim3{40, 1, 1})) << plan.describe();
  EXPECT_EQ(ops::plan_grouped(*b, 4096, res.weights(), opt).launch.grid, (Dim3{132, 1, 1}));
  const auto a = ref::random_activations(gen, kRows * kK);
  std::vector<std::uint16_t> bias;
  for (int e = 0; e < 5; ++e) {
    const auto row = ref::random_bias(gen, kN);
    bias.insert(bias.end(), row.begin(), row.end());
  }
  const DevicePtr da = upload(*b, a), db = upload(*b, bias), dc = b->alloc(kRows * kN * 2);
  b->memset(dc, ref::kPoisonByte, kRows * kN * 2);
  const DevicePtr dcounts = upload(*b, counts), doffsets = upload(*b, offsets);
  const std::size_t before = proc.fd.launches().size();
  ops::run_grouped(plan, b->default_stream(), da, res.weights(), dcounts, doffsets, dc, {}, db);
  b->synchronize(b->default_stream());
  const auto launches = proc.fd.launches();
  ASSERT_EQ(launches.size(), before + 1);
  EXPECT_EQ(launches.back().function, int4 ? "gemm_grouped_int4_fused" : "gemm_grouped_fused");
  const auto c = read<std::uint16_t>(*b, dc, kRows * kN);
  expect_experts_close(c, a, host, counts, offsets, kN, kK, ops::GemmRoute::kFused, format, bias);
  for (std::size_t i = 84 * kN; i < c.size(); ++i) {
    ASSERT_EQ(c[i], ref::kPoisonBf16) << "row " << i / kN << " of no expert was written";
  }
  for (DevicePtr p : {da, db, dc, dcounts, doffsets}) b->free(p);
  res.release(*b);
}

TEST(GroupedLaunch, TheFusedRouteIsOneWaveOverEveryExpertsTiles) {
  expect_fused_route(WeightFormat::kNvfp4);
  expect_fused_route(WeightFormat::kInt4);
}

// The fused route reads weights in the decode layouts only (FP4's, INT4's), and the grouped op has
// no other routes: each refused by name before anything launches.
TEST(GroupedLaunch, RoutesTheGroupedOpDoesNotHaveAreRefused) {
  std::mt19937_64 gen{std::random_device{}()};
  rel::FakeProcess proc;
  std::unique_ptr<Backend> b = proc.make_backend();
  std::vector<HostQuantWeights> host;
  for (int e = 0; e < 2; ++e) {
    host.push_back(
        ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, 32, 64), 32, 64));
  }
  ops::GroupedWeightsResource source(*b, host);
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = true;
  opt.route = ops::GemmRoute::kFused;
  EXPECT_ERROR(ops::plan_grouped(*b, 64, source.weights(), opt), ErrorCode::kInvalidArgument,
               "the fused route reads weights in the decode layout");
  opt.route = ops::GemmRoute::kTiled;
  EXPECT_ERROR(ops::plan_grouped(*b, 64, source.weights(), opt), ErrorCode::kInvalidArgument,
               "is not a grouped route");
  source.release(*b);
}

// Where the module's fused kernels are placeholders (sm_80 and sm_89: no wgmma), asking for the
// fused route is refused by name and kAuto keeps the decode kernels, for FP4 and INT4 experts.
TEST(GroupedLaunch, APlaceholderFusedKernelIsRefusedWhenAskedForAndNeverChosen) {
  std::mt19937_64 gen{std::random_device{}()};
  ModuleSpec w4a16 = rel::w4a16_module();
  w4a16.fake.publish_u32("gemm_grouped_fused_absent", 1);
  w4a16.fake.publish_u32("gemm_grouped_int4_fused_absent", 1);
  Rig rig(RigOptions{.modules = {core_module(), w4a16}});
  CudaBackend& b = rig.b();
  for (const bool int4 : {false, true}) {
    std::vector<HostQuantWeights> host;
    for (int e = 0; e < 2; ++e) {
      ref::Int4Case c;
      c.n = 32;
      c.k = 64;
      c.group = 32;
      host.push_back(int4 ? ref::random_int4(gen, c)
                          : ref::quantize(WeightFormat::kNvfp4,
                                          ref::random_weight_values(gen, 32, 64), 32, 64));
    }
    ops::GroupedWeightsResource res(b, host, "experts", ops::UploadLayout::kDecode);
    ops::GroupedGemmOptions opt;
    opt.allow_unverified = true;
    EXPECT_EQ(ops::plan_grouped(b, 4096, res.weights(), opt).route, ops::GemmRoute::kDecode);
    opt.route = ops::GemmRoute::kFused;
    EXPECT_ERROR(
        ops::plan_grouped(b, 4096, res.weights(), opt), ErrorCode::kUnavailable,
        int4 ? "is a placeholder on this target (it publishes gemm_grouped_int4_fused_absent)"
             : "is a placeholder on this target (it publishes gemm_grouped_fused_absent)");
    res.release(b);
  }
}

}  // namespace
}  // namespace metrale::cuda::testing
