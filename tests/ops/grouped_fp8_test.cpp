// The grouped W8A8 GEMM (ops/grouped_fp8.h) on every backend, in a MoE layer's own sequence:
// random routings aligned and gathered on the device (ops/moe.h), one run_grouped over every
// expert, each expert's rows of C against two float64 references of its own weights and bias
// (A exact, and A cast as the op casts it) under the dense W8A8 op's bounds (their derivation:
// tests/ops/fp8_gemm_test.cpp), contiguous and masked rows, empty experts, one expert taking
// every token, FP32 C; C poisoned first, rows of no expert checked untouched. On the CPU each
// expert's rows must also be the bytes of the dense W8A8 op on that expert alone (the same kernel
// per M), and the experts in the CPU's panel layout are checked against the same bounds. On CUDA
// the kernels run opted in, the tiled one by its own case: the device check's verification of
// them.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/host_module.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/grouped_fp8.h"
#include "metrale/ops/moe.h"
#include "ops/gemm_reference.h"
#include "support/fp8_reference.h"
#include "support/log_capture.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/moe_routing.h"

namespace metrale::testing::gemm {
namespace {

namespace f8 = testing::fp8;

struct Case {
  std::int64_t tokens = 1;
  std::int32_t experts = 1, top_k = 1;
  std::int64_t n = 64, k = 256;
  bool masked = false, bias = false, out_f32 = false;
  double skew = 0.0;  // expert e drawn with weight (e + 1)^-skew

  std::string str() const {
    return fmt::format("T={} E={} k={} N={} K={} {}{}{} skew {}", tokens, experts, top_k, n, k,
                       masked ? "masked" : "contiguous", bias ? " bias" : "",
                       out_f32 ? " fp32 C" : "", skew);
  }
};

std::vector<std::int32_t> random_ids(std::mt19937_64& gen, const Case& c) {
  return toolkit::draw_expert_ids(gen, c.tokens, c.top_k,
                                  toolkit::skewed_expert_weights(c.experts, c.skew));
}

// The experts as the upload takes them (views of the test's own buffers).
std::vector<E4m3BlockWeightsView> views(const std::vector<f8::HostFp8Weights>& host) {
  std::vector<E4m3BlockWeightsView> v;
  for (const f8::HostFp8Weights& h : host) v.push_back({h.n, h.k, h.codes, h.scales});
  return v;
}

// A in [-1, 1) times 2^[-8, 2]: per-128 blocks of varied amax, so the cast's scales vary.
std::vector<std::uint16_t> random_a(std::mt19937_64& gen, std::size_t count) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-8, 2);
  std::vector<std::uint16_t> v(count);
  for (auto& x : v) x = num::f32_to_bf16(std::ldexp(u(gen), e(gen)));
  return v;
}

class GroupedFp8 : public GemmBackendTest {
 protected:
  bool cuda() const { return GetParam() == "cuda"; }

  ops::GroupedFp8Options options(const Case& c) const {
    ops::GroupedFp8Options o;
    o.bias = c.bias;
    o.out_f32 = c.out_f32;
    o.allow_unverified = cuda();
    o.route = route_;
    return o;
  }

  // The route the cases run on (TheTiledRouteAgainstFloat64 sets kTiled).
  ops::GemmRoute route_ = ops::GemmRoute::kAuto;

  // layout kPanels: the experts in the CPU's panel layout, checked against the bounds only (the
  // dense op reads no panels).
  void run_case(const Case& c, ops::UploadLayout layout = ops::UploadLayout::kSource) {
    SCOPED_TRACE(c.str());
    Backend& bk = b();
    std::vector<f8::HostFp8Weights> host;
    for (int e = 0; e < c.experts; ++e) host.push_back(f8::random_weights(c.n, c.k, gen()));
    ops::GroupedFp8WeightsResource res(bk, views(host), "fp8 experts", layout);
    const ops::GroupedFp8Weights& w = res.weights();
    const bool panels = layout == ops::UploadLayout::kPanels;
    ASSERT_EQ(w.packing, panels ? ops::WeightPacking::kPanels : ops::WeightPacking::kSource);
    const ops::MoeShape shape{c.tokens, c.experts, c.top_k, c.masked ? c.tokens : 0};
    const auto rows = static_cast<std::size_t>(shape.row_capacity());
    const auto e_n = static_cast<std::size_t>(c.experts);
    const ops::MoeOptions moe_opt{cuda()};

    const std::vector<std::int32_t> ids = random_ids(gen(), c);
    const std::vector<std::uint16_t> x = random_a(gen(), static_cast<std::size_t>(c.tokens * c.k));
    const ops::MoeRows r{alloc(e_n * 4), alloc(e_n * 4 + 4), alloc(ids.size() * 4)};
    ops::moe_align(bk, stream(), upload(ids), shape, r, moe_opt);
    const DevicePtr a = alloc(rows * static_cast<std::size_t>(c.k) * 2);
    bk.memset(a, 0, rows * static_cast<std::size_t>(c.k) * 2);
    ops::moe_gather(bk, stream(), upload(x), shape, c.k, r.rows, a, moe_opt);

    std::vector<std::uint16_t> bias;
    if (c.bias) bias = random_bias(gen(), c.n * c.experts);
    const std::size_t elem = c.out_f32 ? 4 : 2;
    const DevicePtr out = poisoned(rows * static_cast<std::size_t>(c.n) * elem);
    const ops::GroupedFp8Plan plan = ops::plan_grouped(bk, shape.row_capacity(), w, options(c));
    EXPECT_EQ(plan.gemm.grid.y,
              plan.route == ops::GemmRoute::kTiled ? 1u : static_cast<std::uint32_t>(c.experts))
        << plan.describe();
    // The tiled kernel sums each 128-K block on the FP8 tensor cores: four chained k32 MMAs, each
    // at most twice fp8_gemm_test's allowance for one (toolkit/gemm_tolerance.h) of the running
    // sum; the decode kernels sum on CUDA cores and the CPU in FP32 (no term).
    const double mma = plan.route == ops::GemmRoute::kTiled ? 4 * 2 * toolkit::kFp8MmaTerm : 0.0;
    ops::run_grouped(plan, stream(), a, w, r.counts, r.offsets, out,
                     ops::scratch_workspace(plan, stream()), c.bias ? upload(bias) : DevicePtr{});

    const auto counts = read<std::int32_t>(r.counts, e_n);
    const auto offsets = read<std::int32_t>(r.offsets, e_n + 1);
    const auto a_host = read<std::uint16_t>(a, rows * static_cast<std::size_t>(c.k));
    const auto bytes = read<std::uint8_t>(out, rows * static_cast<std::size_t>(c.n) * elem);
    const std::size_t row_bytes = static_cast<std::size_t>(c.n) * elem;
    std::vector<bool> used(rows, false);
    int checked = 0;
    for (int e = 0; e < c.experts; ++e) {
      const std::int64_t m = counts[e];
      if (m == 0) continue;
      ++checked;
      SCOPED_TRACE(fmt::format("expert {}: rows [{}, {})", e, offsets[e], offsets[e] + m));
      for (std::int64_t i = 0; i < m; ++i) used[static_cast<std::size_t>(offsets[e] + i)] = true;
      const std::vector<std::uint16_t> a_e(a_host.begin() + offsets[e] * c.k,
                                           a_host.begin() + (offsets[e] + m) * c.k);
      const std::uint8_t* got = bytes.data() + static_cast<std::size_t>(offsets[e]) * row_bytes;
      expect_within_bounds(a_e, m, host[static_cast<std::size_t>(e)], bias, e, c, got, mma);
      if (!cuda() && !panels) expect_dense_bytes(w.view(e), offsets[e], m, c, a, bias, e, got);
    }
    EXPECT_GT(checked, 0);
    for (std::size_t row = 0; row < rows; ++row) {
      if (used[row]) continue;
      const auto* p = bytes.data() + row * row_bytes;
      ASSERT_TRUE(std::all_of(p, p + row_bytes, [](std::uint8_t v) { return v == kPoisonByte; }))
          << "row " << row << " of no expert was written";
    }
    res.release(bk);
    free_all();
  }

  // Every element of one expert's rows against the aware and the exact float64 references, with
  // the dense W8A8 op's per-element bounds (fp8_gemm_test.cpp) plus `mma`, the FP8 tensor cores'
  // term per unit of Σ|a8·w| (0 for kernels that sum in FP32).
  static void expect_within_bounds(const std::vector<std::uint16_t>& a_e, std::int64_t m,
                                   const f8::HostFp8Weights& hw,
                                   const std::vector<std::uint16_t>& bias, int e, const Case& c,
                                   const std::uint8_t* got, double mma) {
    const f8::CastA a8 = f8::cast_a(a_e, m, c.k);
    // The kernels' roundings: the products exact, at most K additions, and per 16 (GPU) or 128
    // (CPU) K a product by two scales; the dense bound's count covers both (K/16 ≤ K).
    const double gamma = static_cast<double>(c.k + 2 * (c.k / 16) + 8) * std::ldexp(1.0, -23) + mma;
    const double u8 = c.out_f32 ? 0.0 : std::ldexp(1.0, -8);
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < c.n; ++j) {
        const double bj =
            c.bias ? num::bf16_to_f32(bias[static_cast<std::size_t>(e * c.n + j)]) : 0.0;
        double ref = bj, ref8 = bj, s8 = std::fabs(bj), cast_err = 0;
        for (std::int64_t q = 0; q < c.k; ++q) {
          const auto at = static_cast<std::size_t>(i * c.k + q);
          const double wd = hw.at(j, q), xv = num::bf16_to_f32(a_e[at]);
          ref += xv * wd;
          ref8 += a8.value[at] * wd;
          s8 += std::fabs(a8.value[at] * wd);
          cast_err += (std::max(std::ldexp(std::fabs(xv), -4), std::ldexp(a8.scale[at], -10)) +
                       std::ldexp(std::fabs(xv), -23)) *
                      std::fabs(wd);
        }
        const std::size_t at = static_cast<std::size_t>(i * c.n + j);
        double v = 0;
        if (c.out_f32) {
          float f;
          std::memcpy(&f, got + at * 4, 4);
          ASSERT_FALSE(std::isnan(f)) << "C[" << i << ", " << j << "] was not written";
          v = f;
        } else {
          std::uint16_t h;
          std::memcpy(&h, got + at * 2, 2);
          ASSERT_NE(h, static_cast<std::uint16_t>(kPoisonByte * 0x101))
              << "C[" << i << ", " << j << "] was not written";
          v = num::bf16_to_f32(h);
        }
        ASSERT_LE(std::fabs(v - ref8), u8 * std::fabs(ref8) + (1 + u8) * gamma * s8)
            << "C[" << i << ", " << j << "] = " << v << ", aware reference " << ref8;
        ASSERT_LE(std::fabs(v - ref),
                  u8 * (std::fabs(ref) + cast_err) + cast_err + (1 + u8) * gamma * s8)
            << "C[" << i << ", " << j << "] = " << v << ", exact reference " << ref;
      }
    }
  }

  // The dense W8A8 op on one expert's rows of A gives the grouped GEMM's bytes (the CPU runs the
  // same kernel for both, and the cast is per row).
  void expect_dense_bytes(const ops::Fp8Weights& we, std::int64_t first, std::int64_t m,
                          const Case& c, DevicePtr a, const std::vector<std::uint16_t>& bias, int e,
                          const std::uint8_t* got) {
    const std::size_t elem = c.out_f32 ? 4 : 2;
    const std::size_t bytes = static_cast<std::size_t>(m * c.n) * elem;
    const DevicePtr dc = poisoned(bytes);
    ops::Fp8GemmOptions o;
    o.out_f32 = c.out_f32;
    if (c.bias) {
      o.bias =
          upload(std::vector<std::uint16_t>(bias.begin() + e * c.n, bias.begin() + (e + 1) * c.n));
    }
    const ops::Fp8GemmPlan p = ops::plan(b(), m, we, o);
    ops::run(p, stream(), a.offset(static_cast<std::uint64_t>(first * c.k * 2)), we, dc,
             ops::scratch_workspace(p, stream()), o.bias);
    const auto dense = read<std::uint8_t>(dc, bytes);
    EXPECT_EQ(std::memcmp(dense.data(), got, bytes), 0) << "not the dense W8A8 op's bytes";
  }
};
INSTANTIATE_TEST_SUITE_P(, GroupedFp8, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(GroupedFp8, RandomRoutingsAgainstFloat64) {
  run_case({13, 8, 2, 96, 256});
  run_case({40, 6, 4, 136, 528, true, true, false, 0.5});  // ragged N and K blocks, masked
  run_case({7, 5, 3, 64, 144, false, true, true, 1.0});    // FP32 C
  run_case({5, 3, 1, 200, 2048});                          // 16 K blocks
}

TEST_P(GroupedFp8, EmptyExpertsAndOneExpertTakingAll) {
  run_case({33, 16, 1, 64, 256, false, false, false, 3.0});
  run_case({50, 4, 1, 32, 128, true, true, false, 12.0});  // nearly every token to expert 0
  run_case({1, 64, 8, 64, 256});                           // one token: 56 experts empty
}

// The tiled kernel (CUDA sm_90a, opted in): the cases above, and experts of more than 128 rows
// (slots of 128 and their partial tails), one expert taking nearly all of 300 tokens, and more
// tiles than a wave. The CPU has one grouped W8A8 kernel, its own: there the route is refused
// (GroupedFp8Launch.* checks how); a GPU below sm_90a has the entry as a placeholder.
TEST_P(GroupedFp8, TheTiledRouteAgainstFloat64) {
  if (!cuda()) GTEST_SKIP() << "the tiled route is CUDA's (sm_90a); the CPU has one kernel";
  const char* tiled = "gemm_grouped_e4m3_block128_tiled";
  if (b().has_kernel("fp8", tiled) && b().op_cache().kernel(b(), "fp8", tiled).meta.absent) {
    GTEST_SKIP() << "this GPU's fp8 module has the tiled kernel as a placeholder (it needs sm_90a)";
  }
  route_ = ops::GemmRoute::kTiled;
  run_case({13, 8, 2, 96, 256});
  run_case({40, 6, 4, 136, 528, true, true, false, 0.5});
  run_case({7, 5, 3, 64, 144, false, true, true, 1.0});
  run_case({5, 3, 1, 200, 2048});
  run_case({33, 16, 1, 64, 256, false, false, false, 3.0});
  run_case({1, 64, 8, 64, 256});
  run_case({300, 4, 2, 256, 512});                           // 150 rows an expert
  run_case({300, 8, 1, 136, 272, true, true, false, 12.0});  // nearly every token to expert 0
  // About 20 slots x 10 N tiles: more tiles than a wave of 132 blocks, so blocks walk several
  // (the pipeline drained and restarted between tiles).
  run_case({1024, 8, 2, 1280, 256});
}

// The experts in the CPU's panel layout (Note [E4M3 panels]), the cases above: ragged N (a
// partial last panel) and K blocks, FP32 C, bias, masked rows, empty experts, one expert taking
// every token, 1, 8 and 9 rows an expert (the row tile in registers, the widened block in L1).
// The CUDA kernel reads no panels: there the upload is refused (GroupedFp8Launch.* checks how).
TEST_P(GroupedFp8, ThePanelLayoutAgainstFloat64) {
  if (cuda()) GTEST_SKIP() << "the CUDA module reads no FP8 panels (refusals: GroupedFp8Launch)";
  const auto panels = ops::UploadLayout::kPanels;
  run_case({13, 8, 2, 96, 256}, panels);
  run_case({40, 6, 4, 136, 528, true, true, false, 0.5}, panels);
  run_case({7, 5, 3, 64, 144, false, true, true, 1.0}, panels);
  run_case({5, 3, 1, 200, 2048}, panels);
  run_case({33, 16, 1, 64, 256, false, false, false, 3.0}, panels);
  run_case({72, 8, 1, 40, 256, false, true, false, 0.0}, panels);  // about 9 rows an expert
  run_case({1, 64, 8, 64, 256}, panels);
  // The preferred layout on the CPU is the panels; the upload refuses kDecode, and K not a
  // multiple of 16 for panels; an expert of panels has no dense view.
  Backend& bk = b();
  const f8::HostFp8Weights h = f8::random_weights(64, 144, gen());
  ops::GroupedFp8WeightsResource preferred(bk, views({h}), "fp8 experts",
                                           ops::UploadLayout::kBackendPreferred);
  EXPECT_EQ(preferred.weights().packing, ops::WeightPacking::kPanels);
  EXPECT_ERROR(preferred.weights().view(0), ErrorCode::kInvalidArgument,
               "the experts are in the panel layout");
  EXPECT_ERROR(ops::GroupedFp8WeightsResource(bk, views({h}), "x", ops::UploadLayout::kDecode),
               ErrorCode::kInvalidArgument, "FP8 experts have no decode layout");
  const f8::HostFp8Weights odd = f8::random_weights(64, 132, gen());
  EXPECT_ERROR(ops::GroupedFp8WeightsResource(bk, views({odd}), "x", panels),
               ErrorCode::kInvalidArgument, "the panel layout takes K a multiple of 16; K = 132");
  ops::GroupedFp8WeightsResource odd_pref(bk, views({odd}), "x",
                                          ops::UploadLayout::kBackendPreferred);
  EXPECT_EQ(odd_pref.weights().packing, ops::WeightPacking::kSource);
  // A plan for panels refuses row-major weights of the same shape, and the reverse.
  ops::GroupedFp8WeightsResource source(bk, views({h}));
  const ops::GroupedFp8Plan plan = ops::plan_grouped(bk, 4, preferred.weights());
  EXPECT_NE(plan.describe().find("experts in panels"), std::string::npos) << plan.describe();
  const DevicePtr a = upload(random_a(gen(), 4 * 144)), out = poisoned(4 * 64 * 2);
  const DevicePtr dc = upload(std::vector<std::int32_t>{4}),
                  doff = upload(std::vector<std::int32_t>{0, 4});
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, source.weights(), dc, doff, out,
                                ops::scratch_workspace(plan, stream())),
               ErrorCode::kInvalidArgument,
               "the weights are in the row-major layout; the plan is for the panel");
  const auto got = read<std::uint8_t>(out, 4 * 64 * 2);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](std::uint8_t v) { return v == kPoisonByte; }));
  for (auto* r : {&preferred, &odd_pref, &source}) r->release(bk);
  free_all();
}

TEST_P(GroupedFp8, RowsOutsideTheBuffersAreSkipped) {
  // A caller's own counts and offsets that put an expert's rows past the row capacity: that
  // expert is skipped (its rows would lie outside A and C), the others run.
  Backend& bk = b();
  std::vector<f8::HostFp8Weights> host;
  for (int e = 0; e < 3; ++e) host.push_back(f8::random_weights(64, 128, gen()));
  ops::GroupedFp8WeightsResource res(bk, views(host));
  ops::GroupedFp8Options opt;
  opt.allow_unverified = cuda();
  const ops::GroupedFp8Plan plan = ops::plan_grouped(bk, 8, res.weights(), opt);
  const std::vector<std::int32_t> counts = {3, 4, 2}, offsets = {0, 6, -1, 8};
  const DevicePtr a = upload(random_a(gen(), 8 * 128));
  const DevicePtr out = poisoned(8 * 64 * 2);
  ops::run_grouped(plan, stream(), a, res.weights(), upload(counts), upload(offsets), out,
                   ops::scratch_workspace(plan, stream()));
  const auto got = read<std::uint8_t>(out, 8 * 64 * 2);
  for (std::size_t row = 0; row < 8; ++row) {
    const bool written = row < 3;  // expert 0 only: expert 1 runs past row 8, expert 2 starts at -1
    const auto* p = got.data() + row * 128;
    EXPECT_EQ(std::all_of(p, p + 128, [](std::uint8_t v) { return v == kPoisonByte; }), !written)
        << "row " << row;
  }
  res.release(bk);
}

TEST_P(GroupedFp8, RefusesBadInputsByName) {
  Backend& bk = b();
  const f8::HostFp8Weights h = f8::random_weights(64, 144, gen());
  const f8::HostFp8Weights odd = f8::random_weights(64, 132, gen());
  ops::GroupedFp8WeightsResource res(bk, views({h}));
  ops::GroupedFp8WeightsResource odd_res(bk, views({odd}));
  ops::GroupedFp8Options opt;
  opt.allow_unverified = cuda();
  const auto message = [](const Error& e) { return std::string(e.what()); };
  Error e = expect_error([&] { (void)ops::plan_grouped(bk, 4, odd_res.weights(), opt); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(message(e).find("K = 132 is not a multiple of 16"), std::string::npos) << e.what();
  e = expect_error([&] { (void)ops::plan_grouped(bk, 0, res.weights(), opt); });
  EXPECT_NE(message(e).find("rows = 0"), std::string::npos) << e.what();
  const f8::HostFp8Weights narrow = f8::random_weights(32, 144, gen());
  e = expect_error([&] { (void)ops::GroupedFp8WeightsResource(bk, views({h, narrow})); });
  EXPECT_NE(message(e).find("expert 1 is 32x144 with 4608 codes and 2 scales; expert 0 is 64x144"),
            std::string::npos)
      << e.what();
  // The upload: a NaN code, scales of another count, another K, no experts.
  f8::HostFp8Weights nan = h;
  nan.codes[5 * 144 + 7] = 0xFF;
  e = expect_error([&] { (void)ops::GroupedFp8WeightsResource(bk, views({h, nan})); });
  EXPECT_NE(message(e).find("expert 1's weight [5, 7] is NaN (0xFF)"), std::string::npos)
      << e.what();
  f8::HostFp8Weights short_scales = h;
  short_scales.scales.pop_back();
  e = expect_error([&] { (void)ops::GroupedFp8WeightsResource(bk, views({h, short_scales})); });
  EXPECT_NE(message(e).find("expert 1 is 64x144 with 9216 codes and 1 scales"), std::string::npos)
      << e.what();
  const f8::HostFp8Weights longer = f8::random_weights(64, 160, gen());
  e = expect_error([&] { (void)ops::GroupedFp8WeightsResource(bk, views({h, longer})); });
  EXPECT_NE(message(e).find("expert 1 is 64x160"), std::string::npos) << e.what();
  e = expect_error([&] { (void)ops::GroupedFp8WeightsResource(bk, {}); });
  EXPECT_NE(message(e).find("0 experts is outside [1, 1024]"), std::string::npos) << e.what();
  // Weights described by hand: null codes at plan, misaligned scales at run.
  ops::GroupedFp8Weights null_codes = res.weights();
  null_codes.expert.codes = {};
  e = expect_error([&] { (void)ops::plan_grouped(bk, 4, null_codes, opt); });
  EXPECT_NE(message(e).find("weight codes is null"), std::string::npos) << e.what();
  if (cuda()) {
    e = expect_error([&] { (void)ops::plan_grouped(bk, 4, res.weights(), {}); });
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_NE(message(e).find("allow_unverified"), std::string::npos) << e.what();
  }
  // run: a bias the plan does not take, weights of another shape; nothing written.
  const ops::GroupedFp8Plan plan = ops::plan_grouped(bk, 4, res.weights(), opt);
  const std::vector<std::int32_t> counts = {4}, offsets = {0, 4};
  const DevicePtr a = upload(random_a(gen(), 4 * 144)), out = poisoned(4 * 64 * 2);
  const DevicePtr dc = upload(counts), doff = upload(offsets);
  const ops::Fp8Workspace ws = ops::scratch_workspace(plan, stream());
  e = expect_error([&] {
    ops::run_grouped(plan, stream(), a, res.weights(), dc, doff, out, ws, upload(counts));
  });
  EXPECT_NE(message(e).find("a bias was given to a plan made without one"), std::string::npos)
      << e.what();
  ops::GroupedFp8WeightsResource narrow_res(bk, views({narrow}));
  e = expect_error(
      [&] { ops::run_grouped(plan, stream(), a, narrow_res.weights(), dc, doff, out, ws); });
  EXPECT_NE(message(e).find("the weights are 1 experts of 32x144; the plan is for 1 of 64x144"),
            std::string::npos)
      << e.what();
  e = expect_error([&] { ops::run_grouped(plan, stream(), a, res.weights(), dc, doff, a, ws); });
  EXPECT_NE(message(e).find("overlaps"), std::string::npos) << e.what();
  ops::GroupedFp8Weights shifted = res.weights();
  shifted.expert.scales = shifted.expert.scales.offset(8);
  e = expect_error([&] { ops::run_grouped(plan, stream(), a, shifted, dc, doff, out, ws); });
  EXPECT_NE(message(e).find("weight scales = 0x"), std::string::npos) << e.what();
  EXPECT_NE(message(e).find("is not 16-byte aligned"), std::string::npos) << e.what();
  e = expect_error([&] {
    ops::run_grouped(plan, stream(), a, res.weights(), dc, doff, out, ops::Fp8Workspace{});
  });
  EXPECT_NE(message(e).find("E4M3 A workspace is null"), std::string::npos) << e.what();
  // An edited plan: 64 rows on a workspace planned for 4 would cast 16x past it (A and C of 64
  // rows given, so only the plan's own check stands in the way); its launches or workspace
  // edited alone likewise.
  const DevicePtr a64 = upload(random_a(gen(), 64 * 144)), out64 = poisoned(64 * 64 * 2);
  std::vector<std::pair<const char*, ops::GroupedFp8Plan>> edits(4, {"", plan});
  edits[0].first = "rows";
  edits[0].second.rows = 64;
  edits[1].first = "the cast's grid";
  edits[1].second.cast.grid.x += 1;
  edits[2].first = "the GEMM's grid";
  edits[2].second.gemm.grid.y = 2;
  edits[3].first = "the workspace";
  edits[3].second.workspace.a_codes *= 16;
  for (const auto& [what, edited] : edits) {
    SCOPED_TRACE(what);
    e = expect_error(
        [&] { ops::run_grouped(edited, stream(), a64, res.weights(), dc, doff, out64, ws); });
    EXPECT_NE(message(e).find("are not those plan_grouped makes for its own rows = "),
              std::string::npos)
        << e.what();
  }
  const auto got64 = read<std::uint8_t>(out64, 64 * 64 * 2);
  EXPECT_TRUE(
      std::all_of(got64.begin(), got64.end(), [](std::uint8_t v) { return v == kPoisonByte; }));
  const auto got = read<std::uint8_t>(out, 4 * 64 * 2);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](std::uint8_t v) { return v == kPoisonByte; }));
  res.release(bk);
  odd_res.release(bk);
  narrow_res.release(bk);
}

// An upload that fails at any of its allocations or copies frees what it had allocated: each
// fallible call of a clean upload failed in turn on a CPU backend. (A failed device allocation
// falls back to managed memory, so those uploads succeed and are released.)
TEST(GroupedFp8Upload, AFailureAtAnyCallLeavesNothingAllocated) {
  CpuBackend b(CpuBackendOptions{builtin_host_modules(), 1});
  const LogCapture logs;  // the managed-memory fallback's warning
  std::mt19937_64 gen(7);
  const std::vector<f8::HostFp8Weights> host = {f8::random_weights(64, 144, gen),
                                                f8::random_weights(64, 144, gen)};
  CpuFaults f;
  f.record_calls = true;
  b.set_faults(f);
  ops::GroupedFp8WeightsResource(b, views(host)).release(b);
  const std::size_t calls = b.fault_calls().size();
  ASSERT_GE(calls, 6u);  // two allocations, two copies an expert
  std::size_t failed = 0;
  for (std::size_t at = 1; at <= calls; ++at) {
    CpuFaults fail;
    fail.fail_call_at = at;
    b.set_faults(fail);
    try {
      ops::GroupedFp8WeightsResource r(b, views(host));
      r.release(b);
    } catch (const Error& e) {
      ++failed;
      EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << e.what();
    }
    EXPECT_EQ(b.live_alloc_count(), 0u) << "failing call " << at << " of " << calls;
  }
  EXPECT_GE(failed, 4u);  // every copy's failure reaches the caller
}

}  // namespace
}  // namespace metrale::testing::gemm
