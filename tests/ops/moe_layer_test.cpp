// A whole MoE layer through the ops, as a model runs it (transformers' Qwen3MoeExperts: gate_up
// [E, 2I, H] chunked into gate and up, SiLU(gate) · up, down [E, H, I], the weighted sum over the
// token's experts): moe_route → moe_align → moe_gather → run_grouped (gate_up) → SiLU · up (on
// the host, rounded to BF16 as the model's dtype) → run_grouped (down) → moe_combine, contiguous
// and masked, on every backend (CUDA opted in). Against the float64 layer of the same routing on
// the dequantized weights: four BF16 roundings stand between them (C of gate_up, the activation,
// C of down, the combine), each at most 2^-8 of its value, so the normalized error is held to
// 4 · 2^-8. What the per-op tests cannot see: that the rows the gather wrote are the rows the
// grouped GEMMs and the combine read.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "metrale/numerics.h"
#include "metrale/ops/grouped_gemm.h"
#include "metrale/ops/moe.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "ops/int4_cases.h"

namespace metrale::testing::gemm {
namespace {

double silu(double x) {
  return x / (1.0 + std::exp(-x));
}

// SiLU(gate) · up of every row of gate_up's C [rows, 2 · inter], in FP32 from BF16 and rounded
// to BF16 as the model's dtype (rows of no expert hold whatever; down skips them).
std::vector<std::uint16_t> silu_times_up(const std::vector<std::uint16_t>& h1, std::int64_t inter) {
  const auto rows = static_cast<std::int64_t>(h1.size()) / (2 * inter);
  std::vector<std::uint16_t> act(static_cast<std::size_t>(rows * inter));
  for (std::int64_t row = 0; row < rows; ++row) {
    for (std::int64_t j = 0; j < inter; ++j) {
      const double g = num::bf16_to_f32(h1[row * 2 * inter + j]);
      const double u = num::bf16_to_f32(h1[row * 2 * inter + inter + j]);
      act[row * inter + j] = num::f32_to_bf16(static_cast<float>(silu(g) * u));
    }
  }
  return act;
}

class MoeLayer : public GemmBackendTest {
 protected:
  // The layer after routing and align (rows r): gather x (in `order` where given), grouped
  // gate_up, SiLU(gate) · up on the host (rounded to BF16 as the model's dtype), grouped down,
  // combine. Returns the combined output [tokens, hidden], poisoned before the combine.
  std::vector<std::uint16_t> run_layer(const ops::MoeShape& shape,
                                       const std::vector<std::uint16_t>& x, DevicePtr weights,
                                       const ops::MoeRows& r, const ops::GroupedWeights& w1,
                                       const ops::GroupedWeights& w2,
                                       const ops::MoeColumnOrder& order = {}) {
    const bool cuda = GetParam() == "cuda";
    const std::int64_t rows = shape.row_capacity(), hidden = w1.expert.k, inter = w2.expert.k;
    const ops::MoeOptions mo{cuda};
    ops::GroupedGemmOptions go;
    go.allow_unverified = cuda;
    const DevicePtr xp = alloc(static_cast<std::size_t>(rows * hidden) * 2);
    ops::moe_gather(b(), stream(), upload(x), shape, hidden, r.rows, xp, mo, order);
    const DevicePtr c1 = alloc(static_cast<std::size_t>(rows * 2 * inter) * 2);
    ops::GroupedGemmOptions first = go;
    first.a_in_k_order = static_cast<bool>(order.columns);
    const ops::GroupedGemmPlan p1 = ops::plan_grouped(b(), rows, w1, first);
    ops::run_grouped(p1, stream(), xp, w1, r.counts, r.offsets, c1,
                     ops::scratch_workspace(p1, stream()));
    // Rows of no expert hold whatever; down skips them.
    const std::vector<std::uint16_t> act =
        silu_times_up(read<std::uint16_t>(c1, static_cast<std::size_t>(rows * 2 * inter)), inter);
    const DevicePtr c2 = alloc(static_cast<std::size_t>(rows * hidden) * 2);
    const ops::GroupedGemmPlan p2 = ops::plan_grouped(b(), rows, w2, go);
    ops::run_grouped(p2, stream(), upload(act), w2, r.counts, r.offsets, c2,
                     ops::scratch_workspace(p2, stream()));
    const DevicePtr out = poisoned(static_cast<std::size_t>(shape.tokens * hidden) * 2);
    ops::moe_combine(b(), stream(), c2, shape, hidden, r.rows, weights, out, mo);
    return read<std::uint16_t>(out, static_cast<std::size_t>(shape.tokens * hidden));
  }
};
INSTANTIATE_TEST_SUITE_P(, MoeLayer, ::testing::Values("cpu", "cuda"), backend_name);

// The float64 layer of a routing against its output: per token Σ_j w_j · down_e(SiLU(gate_e · x) ·
// (up_e · x)) with e = id[t, j], weights through gate(e, i, h), up(e, i, h) and down(e, h, i);
// every output element must have been written (poison). Returns the normalized error.
template <class Gate, class Up, class Down>
double layer_error(const std::vector<std::uint16_t>& x, const std::vector<std::int32_t>& id,
                   const std::vector<float>& wt, const std::vector<std::uint16_t>& got,
                   std::int64_t hidden, std::int64_t inter, int top_k, Gate gate, Up up,
                   Down down) {
  const auto tokens = static_cast<std::int64_t>(id.size()) / top_k;
  double err = 0.0, norm = 0.0;
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<double> y(static_cast<std::size_t>(hidden), 0.0);
    for (int j = 0; j < top_k; ++j) {
      const int e = id[t * top_k + j];
      std::vector<double> a(static_cast<std::size_t>(inter));
      for (std::int64_t i = 0; i < inter; ++i) {
        double g = 0.0, u = 0.0;
        for (std::int64_t h = 0; h < hidden; ++h) {
          const double xv = num::bf16_to_f32(x[t * hidden + h]);
          g += xv * gate(e, i, h);
          u += xv * up(e, i, h);
        }
        a[i] = silu(g) * u;
      }
      for (std::int64_t h = 0; h < hidden; ++h) {
        double d = 0.0;
        for (std::int64_t i = 0; i < inter; ++i) d += a[i] * down(e, h, i);
        y[h] += wt[t * top_k + j] * d;
      }
    }
    for (std::int64_t h = 0; h < hidden; ++h) {
      const std::uint16_t bits = got[t * hidden + h];
      if (bits == toolkit::kPoisonBf16) {
        ADD_FAILURE() << "token " << t << " column " << h << " was not written";
        return INFINITY;
      }
      const double diff = num::bf16_to_f32(bits) - y[h];
      err += diff * diff;
      norm += y[h] * y[h];
    }
  }
  EXPECT_GT(norm, 0.0);
  return std::sqrt(err / norm);
}

TEST_P(MoeLayer, Qwen3ExpertsAgainstFloat64) {
  const bool cuda = GetParam() == "cuda";
  constexpr std::int64_t kH = 128, kI = 64;
  constexpr std::int32_t kE = 8, kTopK = 2;
  for (const bool masked : {false, true}) {
    for (const std::int64_t tokens : {1, 11, 40}) {
      SCOPED_TRACE(fmt::format("T={} {}", tokens, masked ? "masked" : "contiguous"));
      Backend& bk = b();
      std::vector<HostQuantWeights> gate_up, down;
      for (int e = 0; e < kE; ++e) {
        gate_up.push_back(
            quantize(WeightFormat::kNvfp4, random_weight_values(gen(), 2 * kI, kH), 2 * kI, kH));
        down.push_back(quantize(WeightFormat::kNvfp4, random_weight_values(gen(), kH, kI), kH, kI));
      }
      ops::GroupedWeightsResource w1(bk, gate_up), w2(bk, down);
      const ops::MoeShape shape{tokens, kE, kTopK, masked ? tokens : 0};
      const ops::MoeOptions mo{cuda};

      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> logits(static_cast<std::size_t>(tokens * kE));
      for (auto& v : logits) v = normal(gen());
      const auto x = random_activations(gen(), static_cast<std::size_t>(tokens * kH), -3, 0);
      const DevicePtr ids = alloc(static_cast<std::size_t>(tokens * kTopK) * 4);
      const DevicePtr weights = alloc(static_cast<std::size_t>(tokens * kTopK) * 4);
      ops::MoeRouting routing;
      routing.top_k = kTopK;
      routing.renormalize = true;
      ops::moe_route(bk, stream(), upload(logits), shape, routing, ids, weights, mo);
      const ops::MoeRows r{alloc(kE * 4), alloc(kE * 4 + 4),
                           alloc(static_cast<std::size_t>(tokens * kTopK) * 4)};
      ops::moe_align(bk, stream(), ids, shape, r, mo);
      const auto got = run_layer(shape, x, weights, r, w1.weights(), w2.weights());
      const auto id = read<std::int32_t>(ids, static_cast<std::size_t>(tokens * kTopK));
      const auto wt = read<float>(weights, static_cast<std::size_t>(tokens * kTopK));

      // The float64 layer of the same routing.
      const double err = layer_error(
          x, id, wt, got, kH, kI, kTopK,
          [&](int e, std::int64_t i, std::int64_t h) { return gate_up[e].weight(i, h); },
          [&](int e, std::int64_t i, std::int64_t h) { return gate_up[e].weight(kI + i, h); },
          [&](int e, std::int64_t h, std::int64_t i) { return down[e].weight(h, i); });
      EXPECT_LE(err, 4.0 / 256.0);
      w1.release(bk);
      w2.release(bk);
      free_all();
    }
  }
}

// GPTQ's desc_act experts (Note [Experts' act order]): each expert's gate and up share one K order
// (they see the same inputs), its down has another; down's is folded into gate_up's rows
// (take_rows, in_stored_order) and gate_up's gathered with x (MoeColumnOrder). Against the float64
// layer of the act-ordered weights in their own K order, as Qwen3ExpertsAgainstFloat64. Either
// order left out (A gathered plainly, or down's fold skipped) fails it.
TEST_P(MoeLayer, ActOrderedInt4ExpertsAgainstFloat64) {
  const bool cuda = GetParam() == "cuda";
  constexpr std::int64_t kH = 256, kI = 64, kTokens = 13;
  constexpr std::int32_t kE = 4, kTopK = 2;
  for (const bool masked : {false, true}) {
    SCOPED_TRACE(masked ? "masked" : "contiguous");
    Backend& bk = b();
    const auto g_idx = [&](std::int64_t k, std::int64_t group) {
      std::vector<std::int32_t> g(static_cast<std::size_t>(k));
      for (std::int64_t j = 0; j < k; ++j)
        g[static_cast<std::size_t>(j)] = static_cast<int>(j / group);
      std::shuffle(g.begin(), g.end(), gen());
      return g;
    };
    const Int4Case half{1, kI, kH, 64, true, true};
    const Int4Case lower{1, kH, kI, 32, true, true};
    std::vector<HostQuantWeights> gate, up, down, gate_up, down_stored;
    for (int e = 0; e < kE; ++e) {
      // Expert 0 without an order of its own (no calibration token reached it, say).
      const auto order_of = [&](const HostQuantWeights& w, const std::vector<std::int32_t>& g) {
        return e == 0 ? w : with_act_order(w, g);
      };
      const std::vector<std::int32_t> shared = g_idx(kH, half.group);
      gate.push_back(order_of(random_int4(gen(), half), shared));
      up.push_back(order_of(random_int4(gen(), half), shared));
      down.push_back(order_of(random_int4(gen(), lower), g_idx(kI, lower.group)));
      // down reads the activation in its stored order: gate's and up's rows taken in it.
      std::vector<std::int64_t> order(static_cast<std::size_t>(kI));
      std::iota(order.begin(), order.end(), 0);
      if (e > 0) order.assign(down[e].k_perm.begin(), down[e].k_perm.end());
      const HostQuantWeights parts[] = {take_rows(gate[e], order), take_rows(up[e], order)};
      gate_up.push_back(stack_rows(parts));
      down_stored.push_back(in_stored_order(down[e]));
    }
    const ops::UploadLayout layout =
        cuda ? ops::UploadLayout::kDecode : ops::UploadLayout::kBackendPreferred;
    ops::GroupedWeightsResource w1(bk, gate_up, "gate_up", layout),
        w2(bk, down_stored, "down", layout);
    ASSERT_TRUE(w1.weights().k_order);
    ASSERT_FALSE(w2.weights().k_order);
    const ops::MoeShape shape{kTokens, kE, kTopK, masked ? kTokens : 0};
    const std::int64_t rows = shape.row_capacity();
    const ops::MoeOptions mo{cuda};
    ops::GroupedGemmOptions go;
    go.allow_unverified = cuda;
    // Act-ordered experts take A only from a caller that says it gathered A in their order.
    EXPECT_ERROR(ops::plan_grouped(bk, rows, w1.weights(), go), ErrorCode::kInvalidArgument,
                 "the experts are act-ordered (k_order)");
    ops::GroupedGemmOptions ordered = go;
    ordered.a_in_k_order = true;
    EXPECT_ERROR(ops::plan_grouped(bk, rows, w2.weights(), ordered), ErrorCode::kInvalidArgument,
                 "a_in_k_order is set for experts without act order");

    std::vector<std::int32_t> id(static_cast<std::size_t>(kTokens * kTopK));
    std::vector<float> wt(id.size());
    std::uniform_real_distribution<float> unit(0.1f, 1.0f);
    for (std::int64_t t = 0; t < kTokens; ++t) {
      id[t * kTopK] = static_cast<std::int32_t>(t % kE);
      id[t * kTopK + 1] = static_cast<std::int32_t>((t + 1 + t % 3) % kE);  // never t % kE
      wt[t * kTopK] = unit(gen());
      wt[t * kTopK + 1] = unit(gen());
    }
    const DevicePtr ids = upload(id), weights = upload(wt);
    const ops::MoeRows r{alloc(kE * 4), alloc(kE * 4 + 4), alloc(id.size() * 4)};
    ops::moe_align(bk, stream(), ids, shape, r, mo);
    const auto x = random_activations(gen(), static_cast<std::size_t>(kTokens * kH), -3, 0);
    const auto got = run_layer(shape, x, weights, r, w1.weights(), w2.weights(),
                               ops::MoeColumnOrder{ids, w1.weights().k_order});

    const double err = layer_error(
        x, id, wt, got, kH, kI, kTopK,
        [&](int e, std::int64_t i, std::int64_t h) { return gate[e].exact_weight(i, h); },
        [&](int e, std::int64_t i, std::int64_t h) { return up[e].exact_weight(i, h); },
        [&](int e, std::int64_t h, std::int64_t i) { return down[e].exact_weight(h, i); });
    EXPECT_LE(err, 4.0 / 256.0);
    w1.release(bk);
    w2.release(bk);
    free_all();
  }
}

}  // namespace
}  // namespace metrale::testing::gemm
