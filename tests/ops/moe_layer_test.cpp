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
#include <random>
#include <vector>

#include "metrale/numerics.h"
#include "metrale/ops/grouped_gemm.h"
#include "metrale/ops/moe.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::gemm {
namespace {

class MoeLayer : public GemmBackendTest {};
INSTANTIATE_TEST_SUITE_P(, MoeLayer, ::testing::Values("cpu", "cuda"), backend_name);

double silu(double x) {
  return x / (1.0 + std::exp(-x));
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
      const std::int64_t rows = shape.row_capacity();
      const ops::MoeOptions mo{cuda};
      ops::GroupedGemmOptions go;
      go.allow_unverified = cuda;

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
      const DevicePtr xp = alloc(static_cast<std::size_t>(rows * kH) * 2);
      ops::moe_gather(bk, stream(), upload(x), shape, kH, r.rows, xp, mo);
      const DevicePtr c1 = alloc(static_cast<std::size_t>(rows * 2 * kI) * 2);
      ops::run_grouped(ops::plan_grouped(bk, rows, w1.weights(), go), stream(), xp, w1.weights(),
                       r.counts, r.offsets, c1);
      // SiLU(gate) · up on every row (rows of no expert hold whatever; down skips them).
      const auto h1 = read<std::uint16_t>(c1, static_cast<std::size_t>(rows * 2 * kI));
      std::vector<std::uint16_t> act(static_cast<std::size_t>(rows * kI));
      for (std::int64_t row = 0; row < rows; ++row) {
        for (std::int64_t j = 0; j < kI; ++j) {
          const double g = num::bf16_to_f32(h1[row * 2 * kI + j]);
          const double u = num::bf16_to_f32(h1[row * 2 * kI + kI + j]);
          act[row * kI + j] = num::f32_to_bf16(static_cast<float>(silu(g) * u));
        }
      }
      const DevicePtr c2 = alloc(static_cast<std::size_t>(rows * kH) * 2);
      ops::run_grouped(ops::plan_grouped(bk, rows, w2.weights(), go), stream(), upload(act),
                       w2.weights(), r.counts, r.offsets, c2);
      const DevicePtr out = poisoned(static_cast<std::size_t>(tokens * kH) * 2);
      ops::moe_combine(bk, stream(), c2, shape, kH, r.rows, weights, out, mo);
      const auto got = read<std::uint16_t>(out, static_cast<std::size_t>(tokens * kH));
      const auto id = read<std::int32_t>(ids, static_cast<std::size_t>(tokens * kTopK));
      const auto wt = read<float>(weights, static_cast<std::size_t>(tokens * kTopK));

      // The float64 layer of the same routing.
      double err = 0.0, norm = 0.0;
      for (std::int64_t t = 0; t < tokens; ++t) {
        std::vector<double> y(kH, 0.0);
        for (int j = 0; j < kTopK; ++j) {
          const int e = id[t * kTopK + j];
          std::vector<double> a(kI);
          for (std::int64_t i = 0; i < kI; ++i) {
            double g = 0.0, u = 0.0;
            for (std::int64_t h = 0; h < kH; ++h) {
              const double xv = num::bf16_to_f32(x[t * kH + h]);
              g += xv * gate_up[e].weight(i, h);
              u += xv * gate_up[e].weight(kI + i, h);
            }
            a[i] = silu(g) * u;
          }
          for (std::int64_t h = 0; h < kH; ++h) {
            double d = 0.0;
            for (std::int64_t i = 0; i < kI; ++i) d += a[i] * down[e].weight(h, i);
            y[h] += wt[t * kTopK + j] * d;
          }
        }
        for (std::int64_t h = 0; h < kH; ++h) {
          const std::uint16_t bits = got[t * kH + h];
          ASSERT_NE(bits, toolkit::kPoisonBf16) << "token " << t << " column " << h;
          const double diff = num::bf16_to_f32(bits) - y[h];
          err += diff * diff;
          norm += y[h] * y[h];
        }
      }
      ASSERT_GT(norm, 0.0);
      EXPECT_LE(std::sqrt(err / norm), 4.0 / 256.0);
      w1.release(bk);
      w2.release(bk);
      free_all();
    }
  }
}

}  // namespace
}  // namespace metrale::testing::gemm
