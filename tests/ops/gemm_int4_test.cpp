// w4a16_gemm on INT4 weights (Note [INT4 weights]): fresh random data over every group size the
// format takes (32, 64, 128, 256 and one scale per row), symmetric and asymmetric, BF16 and FP16
// scales, with and without act order, on the decode and tiled routes and the automatic one, with
// and without bias, BF16 and FP32 C, against the float64 reference (toolkit/gemm_tolerance.h,
// "INT4"). Outputs are poisoned first and the elements past C must stay poisoned. ctest runs this
// program under each lower CPU instruction set too (GemmIsa says which one ran). A backend whose
// kernels do not read INT4 (they publish no <entry>_int4) refuses the weights by name: checked
// here on the CPU for the routes it has no INT4 kernel for.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "ops/int4_cases.h"

namespace metrale::testing::gemm {
namespace {

using ops::GemmRoute;

// Ks for a group: below one 128-step, whole steps, and steps with a tail of whole groups.
std::vector<std::int64_t> ks_of(std::int64_t group) {
  switch (group) {
    case 32:
      return {32, 96, 160, 416};
    case 64:
      return {64, 192, 448};
    case 128:
      return {128, 384, 1152};
    case 256:
      return {256, 768};
    default:  // one scale per row: K itself, any even K (below one step, too)
      return {2, 40, 96, 200, 1000};
  }
}

class GemmInt4 : public Int4GemmTest {
 protected:
  void SetUp() override {
    Int4GemmTest::SetUp();
    if (IsSkipped()) return;
    if (!b().op_cache().kernel(b(), "w4a16", "gemm_decode").meta.int4) {
      GTEST_SKIP() << b().name() << "'s w4a16 kernels do not read INT4 weights in their source "
                   << "layout (gemm_decode publishes no int4 flag)";
    }
  }

  // One case in the source layout.
  GemmRoute run(const Int4Case& c) { return run_case(c, ops::UploadLayout::kSource); }
};

TEST_P(GemmInt4, EveryGroupZeroPointScaleTypeAndActOrderMatchesFloat64) {
  constexpr std::array<std::int64_t, 7> kMs = {1, 2, 3, 5, 16, 17, 33};
  constexpr std::array<std::int64_t, 4> kNs = {1, 7, 65, 257};
  int i = 0;
  for (const std::int64_t group : {32, 64, 128, 256, 0}) {
    for (const bool zp : {false, true}) {
      for (const bool act : {false, true}) {
        const std::vector<std::int64_t> ks = ks_of(group);
        for (std::size_t ki = 0; ki < ks.size(); ++ki, ++i) {
          Int4Case c;
          c.k = ks[ki];
          c.group = group == 0 ? c.k : group;
          c.m = kMs[static_cast<std::size_t>(i) % kMs.size()];
          c.n = kNs[static_cast<std::size_t>(i / 2) % kNs.size()];
          c.zero_points = zp;
          c.act_order = act;
          c.fp16 = i % 3 == 0;
          c.bias = i % 2 == 0;
          c.out_f32 = i % 5 == 1;
          c.route = i % 3 == 1   ? GemmRoute::kDecode
                    : i % 3 == 2 ? GemmRoute::kTiled
                                 : GemmRoute::kAuto;
          const GemmRoute taken = run(c);
          if (c.route != GemmRoute::kAuto) {
            EXPECT_EQ(taken, c.route) << c.str();
          }
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// Every M from 1 to 40 on both routes: the CPU kernel runs rows in register blocks of 1, 2, 4, 8
// and 16, and slices of 16 past that.
TEST_P(GemmInt4, EveryRowBlockOnBothRoutes) {
  for (std::int64_t m = 1; m <= 40; ++m) {
    for (const GemmRoute route : {GemmRoute::kDecode, GemmRoute::kTiled}) {
      Int4Case c;
      c.m = m;
      c.n = 33;
      c.k = 288;
      c.group = 32;
      c.zero_points = m % 2 == 0;
      c.act_order = m % 3 == 0;
      c.route = route;
      run(c);
      if (HasFatalFailure()) return;
    }
  }
}

// Weights that are exactly 0 as code = zero = 0 (W = (0 − 0)·s): the vector kernels sum a·(0 − 8)·s
// and a·(8 − 0)·s apart, which cancel only up to their roundings, so C is near 0, not 0. It is held
// to the INT4 bound (toolkit/gemm_tolerance.h, "INT4"), which counts those sums; a bound on
// Σ|a·w| = 0 alone would call it wrong.
TEST_P(GemmInt4, CancellingZeroPointsStayWithinTheInt4Bound) {
  for (const std::int64_t m : {1, 5, 16}) {
    HostQuantWeights w;
    w.format = WeightFormat::kInt4;
    w.n = 9;
    w.k = 416;
    w.group = 32;
    w.codes.assign(static_cast<std::size_t>(w.n * w.k / 2), 0);
    w.zeros.assign(static_cast<std::size_t>(w.n * w.k / 32), 0);
    w.scales.resize(2 * w.zeros.size());
    for (std::size_t i = 0; i < w.zeros.size(); ++i) {
      const std::uint16_t s = num::f32_to_bf16(std::ldexp(1.0f, static_cast<int>(i % 9) - 4));
      w.scales[2 * i] = static_cast<std::uint8_t>(s & 0xFF);
      w.scales[2 * i + 1] = static_cast<std::uint8_t>(s >> 8);
    }
    // Activations over 43 octaves: a sum of 8 of them no longer fits FP32's 24 bits, so the two
    // sums round (over the default 13 octaves they are exact and cancel to 0).
    const std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(m * w.k), -40.0, 3.0);
    const auto mn = static_cast<std::size_t>(m * w.n);
    const DevicePtr dc = poisoned(mn * 2);
    ops::w4a16_gemm(b(), stream(), upload(a), m, upload_weights(w), dc);
    const Comparison cmp =
        compare(read<std::uint16_t>(dc, mn), reference(a, m, w, {}, AMode::kBf16));
    EXPECT_EQ(cmp.unwritten, 0) << cmp.str();
    EXPECT_LE(cmp.worst, 1.0) << "M=" << m << ": " << cmp.str();
    free_all();
  }
}

// Tensor-parallel shards (ops/parallel_linear.h) of INT4 weights in one process: column shards
// (slice_rows) give C's columns, row shards (slice_columns, at the group's edges; any even split
// with one scale per row; act-ordered weights padded per group: Note [Act order across ranks])
// give FP32 partials whose sum is C, each held to the float64 reference of the whole layer. Act
// order at M = 5 and 40: the decode route and the routes past it (dequant where the backend has a
// dense GEMM).
TEST_P(GemmInt4, ShardsAlongNAndKComposeTheWholeLayer) {
  struct Shape {
    std::int64_t group, m;
    bool act_order;
  };
  for (const Shape shape :
       {Shape{64, 5, false}, Shape{0, 5, false}, Shape{128, 5, true}, Shape{64, 40, true}}) {
    Int4Case c;
    c.m = shape.m;
    c.n = 96;
    c.k = 512;
    c.group = shape.group == 0 ? c.k : shape.group;
    c.zero_points = true;
    c.act_order = shape.act_order;
    SCOPED_TRACE(c.str());
    const HostQuantWeights host = random_int4(gen(), c);
    const std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(c.m * c.k));
    const Reference ref = reference(a, c.m, host, {}, AMode::kBf16);
    constexpr int kRanks = 2;
    // Along N: each rank's columns of C.
    std::vector<std::uint16_t> cols(static_cast<std::size_t>(c.m * c.n));
    for (int r = 0; r < kRanks; ++r) {
      const std::int64_t n0 = r * c.n / kRanks, n1 = (r + 1) * c.n / kRanks;
      const ops::QuantWeights w = upload_weights(slice_rows(host, n0, n1));
      const DevicePtr dc = poisoned(static_cast<std::size_t>(c.m * (n1 - n0)) * 2);
      ops::w4a16_gemm(b(), stream(), upload(a), c.m, w, dc);
      const auto part = read<std::uint16_t>(dc, static_cast<std::size_t>(c.m * (n1 - n0)));
      for (std::int64_t i = 0; i < c.m; ++i) {
        std::copy_n(part.begin() + i * (n1 - n0), n1 - n0, cols.begin() + i * c.n + n0);
      }
    }
    expect_close(compare(cols, ref), kNormTol, "column shards");
    // Along K: FP32 partials on each rank's columns of A, summed.
    std::vector<float> sum(static_cast<std::size_t>(c.m * c.n), 0.0f);
    for (int r = 0; r < kRanks; ++r) {
      const std::int64_t k0 = r * c.k / kRanks, k1 = (r + 1) * c.k / kRanks;
      const HostQuantWeights mine = slice_columns(host, k0, k1);
      EXPECT_EQ(a_columns(mine), k1 - k0);
      EXPECT_EQ(mine.k > k1 - k0, c.act_order) << "act order pads each group's run";
      const ops::QuantWeights w = upload_weights(mine);
      std::vector<std::uint16_t> a_local(static_cast<std::size_t>(c.m * (k1 - k0)));
      for (std::int64_t i = 0; i < c.m; ++i) {
        std::copy_n(a.begin() + i * c.k + k0, k1 - k0, a_local.begin() + i * (k1 - k0));
      }
      ops::GemmOptions o;
      o.out_f32 = true;
      const DevicePtr dc = poisoned(static_cast<std::size_t>(c.m * c.n) * 4);
      ops::w4a16_gemm(b(), stream(), upload(a_local), c.m, w, dc, o);
      const auto part = read<float>(dc, sum.size());
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
    }
    const Comparison cmp = toolkit::compare_f32(sum, ref);
    EXPECT_EQ(cmp.unwritten, 0) << cmp.str();
    EXPECT_LE(cmp.worst, 1.0) << "row shards: " << cmp.str();
    free_all();
  }
}

// Routes without an INT4 kernel are refused by name, before anything runs.
TEST_P(GemmInt4, RoutesWithoutAnInt4KernelAreRefusedByName) {
  Int4Case c;
  c.k = 128;
  const ops::QuantWeights w = upload_weights(random_int4(gen(), c));
  ops::GemmOptions e4m3;
  e4m3.route = GemmRoute::kE4m3;
  e4m3.activations = ops::Activations::kAllowE4m3;
  EXPECT_ERROR(ops::plan(b(), 64, w, e4m3), ErrorCode::kUnavailable, "publishes no gemm_e4m3_int4");
  if (b().dense_gemm_unavailable(DenseKind::kBf16).empty()) {
    ops::GemmOptions dequant;
    dequant.route = GemmRoute::kDequant;
    EXPECT_ERROR(ops::plan(b(), 64, w, dequant), ErrorCode::kUnavailable,
                 "(dequant_bf16 publishes no int4 flag); dequant_int4_bf16 reads them in the "
                 "int4 decode layout");
  }
}

// Weights the INT4 kernels cannot take are refused by name: a panel upload where no kernel reads
// it, a decode upload in a group the int4 decode layout does not take, a group no kernel takes,
// side buffers of the wrong size, a plan for other INT4 weights.
TEST_P(GemmInt4, BadWeightsAndMismatchedPlansAreRefused) {
  Int4Case c;
  c.n = 8;
  c.k = 256;
  c.group = 64;
  c.zero_points = true;
  const HostQuantWeights host = random_int4(gen(), c);
  // The int4 decode layout takes groups of 32, 64 and multiples of 128 only.
  Int4Case odd = c;
  odd.k = odd.group = 96;
  EXPECT_ERROR(ops::upload_weights(b(), random_int4(gen(), odd), ops::UploadLayout::kDecode),
               ErrorCode::kInvalidArgument,
               "int4 weights in groups of 96 (K = 96) have no decode "
               "layout");
  // The panel layout: refused by name where the kernels do not read INT4 weights in it (the
  // CUDA module, the CPU below AVX-512 BF16); gemm_int4_panels_test.cpp runs it where they do.
  if (!ops::reads_panel_layout(b())) {
    EXPECT_ERROR(ops::upload_weights(b(), host, ops::UploadLayout::kPanels),
                 ErrorCode::kUnavailable, "read int4 weights in the panel layout");
  }
  const ops::QuantWeights w = upload_weights(host);
  ops::QuantWeights bad = w;
  bad.group = 48;
  EXPECT_ERROR(ops::plan(b(), 1, bad), ErrorCode::kInvalidArgument, "int4 group 48 for K = 256");
  bad = w;
  bad.zero_points = false;  // the buffer holds them: its size says otherwise
  EXPECT_ERROR(ops::plan(b(), 1, bad), ErrorCode::kInvalidArgument,
               "in the source layout needs 1024 and 64");
  bad = w;
  bad.tensor_scale = 2.0f;
  EXPECT_ERROR(ops::plan(b(), 1, bad), ErrorCode::kInvalidArgument, "no tensor scale");

  // A plan for symmetric weights of the same shape does not run asymmetric ones.
  c.zero_points = false;
  const ops::QuantWeights sym = upload_weights(random_int4(gen(), c));
  const ops::GemmPlan p = ops::plan(b(), 1, sym);
  const DevicePtr a = alloc(static_cast<std::size_t>(c.k) * 2), out = alloc(16 * 2);
  EXPECT_ERROR(ops::run(p, stream(), a, w, out, ops::scratch_workspace(p, stream())),
               ErrorCode::kInvalidArgument, "the plan is for groups of 64");
  // A plan whose INT4 flags were edited onto FP4 weights is refused too.
  HostQuantWeights fp4 = quantize_nvfp4(std::vector<float>(8 * 256, 1.0f), 8, 256);
  const ops::QuantWeights nv = upload_weights(fp4);
  ops::GemmPlan q = ops::plan(b(), 1, nv);
  q.flags |= kGemmZeroPoints;
  EXPECT_ERROR(ops::run(q, stream(), a, nv, out, ops::scratch_workspace(q, stream())),
               ErrorCode::kInvalidArgument, "kernel flags");
}

INSTANTIATE_TEST_SUITE_P(, GemmInt4, ::testing::Values("cpu", "cuda"), backend_name);

}  // namespace
}  // namespace metrale::testing::gemm
