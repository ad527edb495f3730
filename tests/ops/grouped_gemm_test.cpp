// The grouped GEMM (ops/grouped_gemm.h) on every backend, in a MoE layer's own sequence: random
// routings aligned and gathered on the device (ops/moe.h), one run_grouped over every expert,
// each expert's rows of C against the float64 reference of its own weights and bias with the
// decode/tiled tolerance (toolkit/gemm_tolerance.h). Formats NVFP4, MXFP4 and INT4, uploads in
// the source, preferred and decode layouts, contiguous and masked rows, empty experts and one
// expert taking every token; C poisoned first, rows of no expert checked untouched. On the CPU
// each expert's rows must also be the bytes of a dense GEMM on that expert alone (the same
// kernels per M). On CUDA the kernels run opted in: the device check's verification of them.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/host_module.h"
#include "metrale/model_scope.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/grouped_gemm.h"
#include "metrale/ops/moe.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "ops/int4_cases.h"
#include "support/cpu_faults.h"
#include "support/log_capture.h"
#include "toolkit/moe_routing.h"

namespace metrale::testing::gemm {
namespace {

struct Case {
  WeightFormat format = WeightFormat::kNvfp4;
  ops::UploadLayout upload = ops::UploadLayout::kSource;
  std::int64_t tokens = 1;
  std::int32_t experts = 1, top_k = 1;
  std::int64_t n = 64, k = 256;
  bool masked = false, bias = false, out_f32 = false;
  double skew = 0.0;  // expert e drawn with weight (e + 1)^-skew
  std::int64_t group = 128;
  // MXFP4: row 70's first scale code set to 1 (2^-126), which sends the CPU's tiled route for
  // that panel to the decode kernel; the grouped GEMM must take that fallback over the same
  // columns as the dense one.
  bool extreme_scale = false;
  ops::GemmRoute route = ops::GemmRoute::kAuto;
  bool split = false;  // CUDA's plan must split K (the CPU's never does)

  std::string str() const {
    return fmt::format("{} upload {} T={} E={} k={} N={} K={} {}{}{} skew {} route {}",
                       to_string(format), static_cast<int>(upload), tokens, experts, top_k, n, k,
                       masked ? "masked" : "contiguous", bias ? " bias" : "",
                       out_f32 ? " fp32 C" : "", skew, to_string(route));
  }
};

HostQuantWeights random_expert(std::mt19937_64& gen, const Case& c) {
  if (c.format == WeightFormat::kInt4) {
    Int4Case i;
    i.n = c.n;
    i.k = c.k;
    i.group = c.group;
    i.zero_points = true;
    i.fp16 = c.group == 32;
    return random_int4(gen, i);
  }
  const std::vector<float> v = random_weight_values(gen, c.n, c.k);
  HostQuantWeights w = quantize(c.format, v, c.n, c.k);
  if (c.format == WeightFormat::kNvfp4) w.tensor_scale = std::ldexp(1.0f, -int(gen() % 5));
  return w;
}

std::vector<std::int32_t> random_ids(std::mt19937_64& gen, const Case& c) {
  return toolkit::draw_expert_ids(gen, c.tokens, c.top_k,
                                  toolkit::skewed_expert_weights(c.experts, c.skew));
}

class GroupedGemm : public GemmBackendTest {
 protected:
  bool cuda() const { return GetParam() == "cuda"; }

  void run_case(const Case& c) {
    SCOPED_TRACE(c.str());
    Backend& bk = b();
    std::vector<HostQuantWeights> host;
    for (int e = 0; e < c.experts; ++e) host.push_back(random_expert(gen(), c));
    if (c.extreme_scale) {
      for (auto& h : host) h.scales[static_cast<std::size_t>(70 * (c.k / 32))] = 1;
    }
    ops::GroupedWeightsResource res(bk, host, "experts", c.upload);
    const ops::GroupedWeights& w = res.weights();
    const ops::MoeShape shape{c.tokens, c.experts, c.top_k, c.masked ? c.tokens : 0};
    const auto rows = static_cast<std::size_t>(shape.row_capacity());
    const auto e_n = static_cast<std::size_t>(c.experts);
    const ops::MoeOptions moe_opt{cuda()};

    const std::vector<std::int32_t> ids = random_ids(gen(), c);
    const std::vector<std::uint16_t> x =
        random_activations(gen(), static_cast<std::size_t>(c.tokens * c.k));
    const ops::MoeRows r{alloc(e_n * 4), alloc(e_n * 4 + 4), alloc(ids.size() * 4)};
    ops::moe_align(bk, stream(), upload(ids), shape, r, moe_opt);
    const DevicePtr a = alloc(rows * static_cast<std::size_t>(c.k) * 2);
    bk.memset(a, 0, rows * static_cast<std::size_t>(c.k) * 2);
    ops::moe_gather(bk, stream(), upload(x), shape, c.k, r.rows, a, moe_opt);

    std::vector<std::uint16_t> bias;
    if (c.bias) bias = random_bias(gen(), c.n * c.experts);
    const std::size_t elem = c.out_f32 ? 4 : 2;
    const DevicePtr out = poisoned(rows * static_cast<std::size_t>(c.n) * elem);
    ops::GroupedGemmOptions opt;
    opt.bias = c.bias;
    opt.out_f32 = c.out_f32;
    opt.allow_unverified = cuda();
    opt.route = c.route;
    const ops::GroupedGemmPlan plan = ops::plan_grouped(bk, shape.row_capacity(), w, opt);
    // CUDA's fused kernel is persistent (a 1-D wave); the decode kernels and the CPU's twins
    // have a block row per expert.
    const bool persistent = cuda() && plan.route == ops::GemmRoute::kFused;
    EXPECT_EQ(plan.launch.grid.y, persistent ? 1u : static_cast<std::uint32_t>(c.experts))
        << plan.describe();
    // The CPU's twins write C themselves (no _split_k); CUDA's decode kernels split K where the
    // blocks of the experts that can have rows fill the device's waves poorly.
    if (!cuda()) {
      EXPECT_EQ(plan.splits, 1) << plan.describe();
    } else if (c.split) {
      EXPECT_GT(plan.splits, 1) << plan.describe();
    }
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
      const std::span<const std::uint16_t> a_e(a_host.data() + offsets[e] * c.k,
                                               static_cast<std::size_t>(m * c.k));
      const std::span<const std::uint16_t> bias_e =
          c.bias
              ? std::span<const std::uint16_t>(bias.data() + e * c.n, static_cast<std::size_t>(c.n))
              : std::span<const std::uint16_t>{};
      const toolkit::GemmTolerance tol = toolkit::gemm_tolerance(plan.route, c.format);
      const toolkit::Reference ref = toolkit::reference(a_e, m, host[e], bias_e, tol);
      const std::uint8_t* got = bytes.data() + static_cast<std::size_t>(offsets[e]) * row_bytes;
      if (c.out_f32) {
        std::vector<float> o(static_cast<std::size_t>(m * c.n));
        std::memcpy(o.data(), got, o.size() * 4);
        const toolkit::Comparison cmp = toolkit::compare_f32(o, ref);
        EXPECT_EQ(cmp.unwritten, 0) << cmp.str();
        EXPECT_LE(cmp.worst, 1.0) << cmp.str();
      } else {
        std::vector<std::uint16_t> o(static_cast<std::size_t>(m * c.n));
        std::memcpy(o.data(), got, o.size() * 2);
        expect_close(toolkit::compare(o, ref), tol.normalized, "against float64");
      }
      if (!cuda()) expect_dense_bytes(w.view(e), offsets[e], m, c, a, bias_e, got);
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

  // The dense GEMM of one expert on its rows of A gives the grouped GEMM's bytes (the CPU runs the
  // same kernels per M for both).
  void expect_dense_bytes(const ops::QuantWeights& we, std::int64_t first, std::int64_t m,
                          const Case& c, DevicePtr a, std::span<const std::uint16_t> bias_e,
                          const std::uint8_t* got) {
    const std::size_t elem = c.out_f32 ? 4 : 2;
    const std::size_t bytes = static_cast<std::size_t>(m * c.n) * elem;
    const DevicePtr dc = poisoned(bytes);
    ops::GemmOptions o;
    o.out_f32 = c.out_f32;
    if (c.bias) o.bias = upload(std::vector<std::uint16_t>(bias_e.begin(), bias_e.end()));
    ops::w4a16_gemm(b(), stream(), a.offset(static_cast<std::uint64_t>(first * c.k * 2)), m, we, dc,
                    o);
    const auto dense = read<std::uint8_t>(dc, bytes);
    EXPECT_EQ(std::memcmp(dense.data(), got, bytes), 0) << "not the dense GEMM's bytes";
  }
};
INSTANTIATE_TEST_SUITE_P(, GroupedGemm, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(GroupedGemm, EachFormatAndUploadAgainstFloat64) {
  using U = ops::UploadLayout;
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const U u : {U::kSource, U::kBackendPreferred, U::kDecode}) {
      run_case({f, u, 13, 8, 2, 96, 256, false, false, false, 1.0});
      run_case({f, u, 40, 6, 4, 64, 512, true, true, false, 0.5});
    }
  }
  for (const U u : {U::kSource, U::kBackendPreferred, U::kDecode}) {
    if (cuda() && u == U::kSource) continue;  // CUDA reads INT4 in the int4 decode layout only
    Case c{WeightFormat::kInt4, u, 21, 8, 2, 64, 256, false, true, false, 1.0};
    run_case(c);
    c.group = 32;
    c.masked = true;
    run_case(c);
  }
}

TEST_P(GroupedGemm, EmptyExpertsOneExpertTakingAllAndFp32C) {
  // Skewed routings leave experts empty; with E = 4 and skew 12 nearly every token picks expert 0.
  run_case({WeightFormat::kNvfp4, ops::UploadLayout::kBackendPreferred, 33, 16, 1, 64, 256, false,
            false, false, 3.0});
  run_case({WeightFormat::kMxfp4, ops::UploadLayout::kSource, 50, 4, 1, 32, 128, true, true, false,
            12.0});
  run_case(
      {WeightFormat::kNvfp4, ops::UploadLayout::kSource, 9, 3, 2, 64, 256, false, true, true, 0.0});
  run_case({WeightFormat::kNvfp4, ops::UploadLayout::kSource, 1, 64, 8, 64, 256, false, false,
            false, 0.0});
  Case extreme{
      WeightFormat::kMxfp4, ops::UploadLayout::kSource, 16, 1, 1, 256, 2048, false, false, true};
  extreme.extreme_scale = true;
  run_case(extreme);
}

// Split-K on the decode route (CUDA, 132 SMs: K = 2560 cut at 1024-K units into 2 or 3 slices over
// grid z, the last short, each expert's partials summed by gemm_grouped_split_reduce, 256 columns
// a block; the CPU runs the same cases unsplit): every decode kernel's layout, N past one reduction
// block, bias, FP32 C, masked rows, one expert taking nearly all of 40 rows (the decode kernel's
// passes of 16 rows).
TEST_P(GroupedGemm, SplitKOnTheDecodeRouteAgainstFloat64) {
  using U = ops::UploadLayout;
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4, WeightFormat::kInt4}) {
    for (const U u : {U::kSource, U::kDecode}) {
      if (cuda() && f == WeightFormat::kInt4 && u == U::kSource) continue;  // INT4 decode layout
      Case c{f, u, 3, 8, 2, 288, 2560, false, true, false, 1.0};
      c.split = true;
      run_case(c);
      c = Case{f, u, 40, 4, 1, 40, 2560, true, false, true, 12.0};
      c.route = ops::GemmRoute::kDecode;
      c.split = true;
      run_case(c);
    }
  }
}

// The fused route (decode-layout weights; CUDA: gemm_grouped_fused, the CPU: its decode twin):
// experts of a few rows to a few hundred (slots of 128 whole and partial), partial N tiles, bias,
// FP32 C, masked rows, one expert taking every token. Asked for by route: the automatic choice
// takes it only once a device run verified it.
TEST_P(GroupedGemm, TheFusedRouteOnTheDecodeLayoutAgainstFloat64) {
  using U = ops::UploadLayout;
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    Case c{f, U::kDecode, 300, 8, 2, 96, 256, false, true, false, 1.0};
    c.route = ops::GemmRoute::kFused;
    run_case(c);
    c = Case{f, U::kDecode, 200, 4, 1, 160, 384, true, false, true, 12.0};
    c.route = ops::GemmRoute::kFused;
    run_case(c);
  }
}

// The fused route on INT4 experts in the INT4 decode layout (CUDA: gemm_grouped_int4_fused, which
// rounds each weight to BF16 once as the dequant route does, held to that route's weight
// rounding; the CPU: the INT4 decode twin): groups of 128 with BF16 scales (one side entry a K
// block) and of 32 with FP16 scales (one a 32-K span), zero points, experts of a few rows to a few
// hundred, bias, FP32 C, masked rows, one expert taking nearly every token.
TEST_P(GroupedGemm, TheFusedRouteOnTheInt4DecodeLayoutAgainstFloat64) {
  Case c{
      WeightFormat::kInt4, ops::UploadLayout::kDecode, 300, 8, 2, 96, 256, false, true, false, 1.0};
  c.route = ops::GemmRoute::kFused;
  run_case(c);
  c = Case{WeightFormat::kInt4,
           ops::UploadLayout::kDecode,
           200,
           4,
           1,
           160,
           384,
           true,
           false,
           true,
           12.0};
  c.route = ops::GemmRoute::kFused;
  c.group = 32;
  run_case(c);
}

TEST_P(GroupedGemm, RowsOutsideTheBuffersAreSkipped) {
  // A caller's own counts and offsets that put an expert's rows past the row capacity: that
  // expert is skipped (its rows would lie outside A and C), the others run.
  Backend& bk = b();
  std::vector<HostQuantWeights> host;
  const Case c{WeightFormat::kNvfp4, ops::UploadLayout::kSource, 8, 3, 1, 64, 128};
  for (int e = 0; e < 3; ++e) host.push_back(random_expert(gen(), c));
  ops::GroupedWeightsResource res(bk, host);
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = cuda();
  const ops::GroupedGemmPlan plan = ops::plan_grouped(bk, 8, res.weights(), opt);
  const std::vector<std::int32_t> counts = {3, 4, 2}, offsets = {0, 6, -1, 8};
  const DevicePtr a = upload(random_activations(gen(), 8 * 128));
  const DevicePtr out = poisoned(8 * 64 * 2);
  ops::run_grouped(plan, stream(), a, res.weights(), upload(counts), upload(offsets), out,
                   ops::scratch_workspace(plan, stream()));
  const auto got = read<std::uint16_t>(out, 8 * 64);
  for (int row = 0; row < 8; ++row) {
    const bool written = row < 3;  // expert 0 only: expert 1 ends at 10, expert 2 starts at -1
    EXPECT_EQ(std::count(got.begin() + row * 64, got.begin() + row * 64 + 64, toolkit::kPoisonBf16),
              written ? 0 : 64)
        << "row " << row;
  }
  res.release(bk);
}

TEST_P(GroupedGemm, BadWeightsAndCallsAreRefused) {
  Backend& bk = b();
  const Case c{WeightFormat::kNvfp4, ops::UploadLayout::kSource, 4, 2, 1, 64, 128};
  std::vector<HostQuantWeights> host = {random_expert(gen(), c), random_expert(gen(), c)};
  HostQuantWeights wide = random_expert(
      gen(), Case{WeightFormat::kNvfp4, ops::UploadLayout::kSource, 4, 2, 1, 96, 128});
  EXPECT_ERROR(ops::GroupedWeightsResource(bk, std::vector<HostQuantWeights>{host[0], wide}),
               ErrorCode::kInvalidArgument, "expert 1 has N 96 where expert 0 has 64");
  const HostQuantWeights mx = random_expert(
      gen(), Case{WeightFormat::kMxfp4, ops::UploadLayout::kSource, 4, 2, 1, 64, 128});
  EXPECT_ERROR(ops::GroupedWeightsResource(bk, std::vector<HostQuantWeights>{host[0], mx}),
               ErrorCode::kInvalidArgument, "expert 1 has format mxfp4 where expert 0 has nvfp4");
  EXPECT_ERROR(
      ops::GroupedWeightsResource(
          bk,
          std::vector<HostQuantWeights>{host[0], with_layout(host[1], WeightLayout::kTransposed)}),
      ErrorCode::kInvalidArgument, "expert 1 has layout transposed where expert 0 has row-major");
  // Codes that do not fit N and K, uploaded as they are: refused before anything is allocated
  // (only the plan refused them before, the bytes already uploaded).
  HostQuantWeights short_codes = host[1];
  short_codes.codes.resize(short_codes.codes.size() / 2);
  const std::size_t live = bk.live_bytes();
  EXPECT_ERROR(ops::GroupedWeightsResource(bk, std::vector<HostQuantWeights>{host[0], short_codes},
                                           "e", ops::UploadLayout::kSource),
               ErrorCode::kInvalidArgument,
               "[GroupedWeightsResource] expert 1: nvfp4 weights of n = 64, k = 128 need 4096 "
               "code bytes, got 2048");
  EXPECT_EQ(bk.live_bytes(), live);
  Int4Case ic;
  ic.n = 64;
  ic.k = 128;
  const HostQuantWeights plain = random_int4(gen(), ic);
  ic.act_order = true;
  const HostQuantWeights ordered = random_int4(gen(), ic);
  // Act order on some experts (Note [Experts' act order]): the others read K in its own order.
  ops::GroupedWeightsResource mixed(bk, std::vector<HostQuantWeights>{plain, ordered});
  ASSERT_TRUE(mixed.weights().k_order);
  EXPECT_FALSE(mixed.weights().expert.act_order);
  const auto order = read<std::int32_t>(mixed.weights().k_order, 2 * 128);
  for (std::size_t j = 0; j < 128; ++j) {
    ASSERT_EQ(order[j], static_cast<std::int32_t>(j));
    ASSERT_EQ(order[128 + j], ordered.k_perm[j]);
  }
  ops::GroupedGemmOptions plain_a;
  plain_a.allow_unverified = cuda();
  EXPECT_ERROR(ops::plan_grouped(bk, 4, mixed.weights(), plain_a), ErrorCode::kInvalidArgument,
               "the experts are act-ordered (k_order)");
  mixed.release(bk);
  EXPECT_ERROR(
      ops::GroupedWeightsResource(bk, std::vector<HostQuantWeights>{slice_columns(ordered, 0, 64)}),
      ErrorCode::kInvalidArgument, "expert 0 is a K slice");
  HostQuantWeights short_order = ordered;
  short_order.k_perm.pop_back();
  EXPECT_ERROR(ops::GroupedWeightsResource(bk, std::vector<HostQuantWeights>{plain, short_order}),
               ErrorCode::kInvalidArgument, "expert 1 has 127 act-order entries for K = 128");
  EXPECT_ERROR(ops::GroupedWeightsResource(bk, std::span<const HostQuantWeights>{}),
               ErrorCode::kInvalidArgument, "0 experts");
  ops::GroupedWeightsResource res(bk, host);
  ops::GroupedGemmOptions opt;
  opt.allow_unverified = cuda();
  EXPECT_ERROR(ops::plan_grouped(bk, 0, res.weights(), opt), ErrorCode::kInvalidArgument,
               "rows = 0");
  const ops::GroupedGemmPlan plan = ops::plan_grouped(bk, 4, res.weights(), opt);
  const DevicePtr a = upload(random_activations(gen(), 4 * 128));
  const DevicePtr counts = upload(std::vector<std::int32_t>{2, 2});
  const DevicePtr offsets = upload(std::vector<std::int32_t>{0, 2, 4});
  const DevicePtr out = poisoned(4 * 64 * 2);
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, res.weights(), counts, offsets, a, {}),
               ErrorCode::kInvalidArgument, "overlaps");
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, res.weights(), DevicePtr{}, offsets, out, {}),
               ErrorCode::kInvalidArgument, "counts is null");
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, res.weights(), counts, offsets, out, {}, a),
               ErrorCode::kInvalidArgument, "a bias was given to a plan made without one");
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, res.weights(), counts, counts, out, {}),
               ErrorCode::kInvalidArgument, "offsets");
  ops::GroupedWeights said_ordered = res.weights();
  said_ordered.k_order = counts;
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, said_ordered, counts, offsets, out, {}),
               ErrorCode::kInvalidArgument,
               "the weights are act-ordered (k_order), the plan is not");
  ops::GroupedGemmOptions in_order = opt;
  in_order.a_in_k_order = true;
  EXPECT_ERROR(ops::plan_grouped(bk, 4, res.weights(), in_order), ErrorCode::kInvalidArgument,
               "a_in_k_order is set for experts without act order");
  ops::GroupedWeights other = res.weights();
  other.experts = 1;
  other.tensor_scales.resize(1);
  other.folds.resize(1);
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, other, counts, offsets, out, {}),
               ErrorCode::kInvalidArgument, "not the plan's");
  EXPECT_ERROR(res.weights().view(2), ErrorCode::kInvalidArgument, "expert 2");
  // Every expert's tensor scale is checked, not expert 0's alone.
  ops::GroupedWeights nan_scale = res.weights();
  nan_scale.tensor_scales[1] = std::nanf("");
  EXPECT_ERROR(ops::plan_grouped(bk, 4, nan_scale, opt), ErrorCode::kInvalidArgument,
               "expert 1's tensor scale nan");
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, nan_scale, counts, offsets, out, {}),
               ErrorCode::kInvalidArgument, "expert 1's tensor scale nan");
  // INT4 experts in the INT4 decode layout carry no fold (the INT4 decode kernel reads none, the
  // fused one would apply it): one set by hand is refused.
  Int4Case i4;
  i4.n = 64;
  i4.k = 128;
  ops::GroupedWeightsResource int4(
      bk, std::vector<HostQuantWeights>{random_int4(gen(), i4), random_int4(gen(), i4)}, "int4",
      ops::UploadLayout::kDecode);
  ops::GroupedWeights folded = int4.weights();
  folded.folds[1] = 3;
  EXPECT_ERROR(ops::plan_grouped(bk, 4, folded, opt), ErrorCode::kInvalidArgument,
               "expert 1's fold 3");
  int4.release(bk);
  // Weights described with fewer scale bytes than the plan's (a side buffer without the zero
  // points the plan reads, say) are refused, not read past their end.
  ops::GroupedWeights short_scales = res.weights();
  short_scales.expert.scales_bytes /= 2;
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, short_scales, counts, offsets, out, {}),
               ErrorCode::kInvalidArgument, "not the plan's");
  // Weights described by hand with null codes, or scales off the kernels' 16-byte loads.
  ops::GroupedWeights null_codes = res.weights();
  null_codes.expert.codes = {};
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, null_codes, counts, offsets, out, {}),
               ErrorCode::kInvalidArgument, "weight codes is null");
  ops::GroupedWeights shifted = res.weights();
  shifted.expert.scales = shifted.expert.scales.offset(8);
  EXPECT_ERROR(ops::run_grouped(plan, stream(), a, shifted, counts, offsets, out, {}),
               ErrorCode::kInvalidArgument, "is not 16-byte aligned");
  res.release(bk);
  const std::vector<std::uint16_t> untouched = read<std::uint16_t>(out, 4 * 64);
  EXPECT_EQ(std::count(untouched.begin(), untouched.end(), toolkit::kPoisonBf16), 4 * 64);
}

// The bytes of every buffer of grouped weights, in allocation order.
std::vector<std::vector<std::uint8_t>> buffers_of(Backend& b, const ops::GroupedWeights& w) {
  const auto e = static_cast<std::uint64_t>(w.experts);
  std::vector<std::pair<DevicePtr, std::uint64_t>> parts = {{w.expert.codes, w.codes_stride * e},
                                                            {w.expert.scales, w.scales_stride * e},
                                                            {w.table, e * 8}};
  if (w.k_order) parts.emplace_back(w.k_order, e * static_cast<std::uint64_t>(w.expert.k) * 4);
  std::vector<std::vector<std::uint8_t>> out;
  for (const auto& [ptr, bytes] : parts) {
    out.emplace_back(static_cast<std::size_t>(bytes));
    b.copy_d2h(out.back().data(), ptr, out.back().size());
  }
  return out;
}

// An upload that fails at any of its allocations or copies frees what it had allocated, and one
// that succeeds (a failed device allocation falls back to managed memory) holds the bytes a clean
// upload holds: each fallible call of a clean upload failed in turn, with device memory free and
// full, for FP4 as it is and packed, and act-ordered INT4 (its fourth buffer, k_order).
TEST(GroupedGemmUpload, AFailureAtAnyCallLeavesNothingAllocated) {
  std::mt19937_64 gen{std::random_device{}()};
  Int4Case i4;
  i4.n = 32;
  i4.k = 128;
  i4.zero_points = true;
  i4.act_order = true;
  for (const auto& [format, upload] :
       {std::pair{WeightFormat::kNvfp4, ops::UploadLayout::kSource},
        std::pair{WeightFormat::kMxfp4, ops::UploadLayout::kBackendPreferred},
        std::pair{WeightFormat::kInt4, ops::UploadLayout::kBackendPreferred}}) {
    SCOPED_TRACE(fmt::format("{}, upload {}", to_string(format), static_cast<int>(upload)));
    std::vector<HostQuantWeights> host;
    for (int e = 0; e < 3; ++e) {
      host.push_back(format == WeightFormat::kInt4
                         ? random_int4(gen, i4)
                         : quantize(format, random_weight_values(gen, 32, 128), 32, 128));
    }
    std::size_t calls = 0, allocs = 0;
    std::vector<std::vector<std::uint8_t>> want;
    {
      CpuBackend b(CpuBackendOptions{builtin_host_modules(), 1});
      CpuFaults f;
      f.record_calls = true;
      b.set_faults(f);
      ops::GroupedWeightsResource r(b, host, "experts", upload);
      const std::vector<std::string> names = b.fault_calls();
      calls = names.size();
      allocs = static_cast<std::size_t>(std::count(names.begin(), names.end(), "alloc"));
      b.set_faults(CpuFaults{});
      want = buffers_of(b, r.weights());
      r.release(b);
    }
    // Three or four allocations, a copy of each expert into codes and scales, and the table.
    ASSERT_EQ(allocs, format == WeightFormat::kInt4 ? 4u : 3u);
    ASSERT_GE(calls, allocs + 2u * 3u + 1u);
    for (const bool device_full : {false, true}) {
      std::size_t failures = 0;
      for (std::uint64_t at = 1; at <= calls; ++at) {
        SCOPED_TRACE(fmt::format("call #{} of {} fails{}", at, calls,
                                 device_full ? ", device memory full" : ""));
        CpuBackend b(CpuBackendOptions{builtin_host_modules(), 1});
        b.set_faults(failing_call(at, device_full));
        const LogCapture quiet(log::Level::kError);  // the managed-memory warning
        try {
          ops::GroupedWeightsResource r(b, host, "experts", upload);
          b.set_faults(CpuFaults{});
          const auto got = buffers_of(b, r.weights());
          ASSERT_EQ(got.size(), want.size());
          for (std::size_t i = 0; i < got.size(); ++i) {
            if (got[i] == want[i]) continue;
            const auto at_byte = std::mismatch(got[i].begin(), got[i].end(), want[i].begin());
            ADD_FAILURE() << "buffer " << i << " differs from byte "
                          << (at_byte.first - got[i].begin()) << " of " << got[i].size() << ": "
                          << int(*at_byte.first) << " vs " << int(*at_byte.second);
          }
          r.release(b);
        } catch (const Error& e) {
          ++failures;
          EXPECT_THAT(e.what(), ::testing::HasSubstr("injected failure"));
        }
        EXPECT_EQ(b.live_alloc_count(), 0u) << b.alloc_report();
        EXPECT_EQ(b.live_bytes(), 0u);
      }
      // Every call but an allocation (which falls back to managed memory) fails the upload;
      // with device memory full, each allocation's managed fallback fails it.
      EXPECT_EQ(failures, device_full ? allocs : calls - allocs);
    }
  }
}

// A plan's kernels belong to its backend's modules: once teardown released them, the plan is
// refused (kState) before anything is checked or launched.
TEST(GroupedGemmLifetime, APlanIsRefusedOnceItsModelIsTornDown) {
  std::mt19937_64 gen{std::random_device{}()};
  ModelScope model(std::make_unique<CpuBackend>());
  Backend& b = model.backend();
  std::vector<HostQuantWeights> host;
  for (int e = 0; e < 2; ++e) {
    host.push_back(quantize(WeightFormat::kNvfp4, random_weight_values(gen, 32, 64), 32, 64));
  }
  ops::GroupedWeightsResource res(b, host);
  const DevicePtr a = b.alloc(4 * 64 * 2), c = b.alloc(4 * 32 * 2), counts = b.alloc(8),
                  offsets = b.alloc(12);
  const ops::GroupedGemmPlan plan = ops::plan_grouped(b, 4, res.weights());
  b.op_cache().release(b);
  EXPECT_ERROR(ops::run_grouped(plan, b.default_stream(), a, res.weights(), counts, offsets, c, {}),
               ErrorCode::kState, "[run_grouped] the plan's backend was torn down");
  res.release(b);
  for (const DevicePtr p : {a, c, counts, offsets}) b.free(p);
}

}  // namespace
}  // namespace metrale::testing::gemm
