// NVFP4 / MXFP4 weights on the W8A8 route (ops/fp8_requant.h): requantized at upload, multiplied
// by the W8A8 op, and held to the float64 product with the ORIGINAL 4-bit weights, element by
// element and in the norm (the bounds and their derivation: toolkit/w8a8_reference.h), outputs
// poisoned first; the stated memory cost is what the ledger sees; bad weights allocate nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/e4m3_block.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/fp8_requant.h"
#include "ops/gemm_reference.h"
#include "toolkit/w8a8_reference.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;

struct Problem {
  std::int64_t m, n, k;
  WeightFormat format;
  WeightLayout layout;
  bool bias;
};

HostQuantWeights random_4bit(const Problem& s, std::mt19937_64& gen) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> f(static_cast<std::size_t>(s.n * s.k));
  for (float& x : f) x = normal(gen);
  return with_layout(
      s.format == WeightFormat::kNvfp4 ? quantize_nvfp4(f, s.n, s.k) : quantize_mxfp4(f, s.n, s.k),
      s.layout);
}

// The numerics suite's instances ("cpu", "cuda"; gpu.ops_numerics_suite runs the "/cuda" ones).
class W8a8RequantNumerics : public testing::gemm::W8a8BackendTest {
 protected:
  // Runs s and returns the normalized error against the exact reference (checking every element).
  double check(const Problem& s, double mma_term) {
    SCOPED_TRACE(::testing::Message()
                 << "M=" << s.m << " N=" << s.n << " K=" << s.k << " " << to_string(s.format)
                 << " layout " << static_cast<int>(s.layout) << " bias=" << s.bias);
    const HostQuantWeights hw = random_4bit(s, gen());
    const HostE4m3BlockWeights wq = requantize_e4m3_block128(hw);
    ops::Fp8Weights w = ops::upload_requantized_fp8_weights(b(), hw);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int> e(-8, 2);
    std::vector<std::uint16_t> ha(static_cast<std::size_t>(s.m * s.k)),
        hbias(static_cast<std::size_t>(s.n));
    for (auto& x : ha) x = num::f32_to_bf16(std::ldexp(u(gen()), e(gen())));
    for (auto& x : hbias) x = num::f32_to_bf16(u(gen()));
    const DevicePtr a = upload(ha);
    const DevicePtr bias = s.bias ? upload(hbias) : DevicePtr{};
    const DevicePtr c = poisoned(static_cast<std::size_t>(s.m * s.n) * 2);
    ops::w8a8_gemm(b(), stream(), a, s.m, w, c, bias);
    const auto out = read<std::uint16_t>(c, static_cast<std::size_t>(s.m * s.n));
    ops::free_fp8_weights(b(), w);

    double err2 = 0, ref2 = 0, aware_err2 = 0, aware2 = 0;
    for (std::int64_t i = 0; i < s.m; ++i) {
      const std::span<const std::uint16_t> row(ha.data() + i * s.k, static_cast<std::size_t>(s.k));
      const toolkit::CastRow a8 = toolkit::cast_row(row);
      for (std::int64_t j = 0; j < s.n; ++j) {
        const double bj = s.bias ? num::bf16_to_f32(hbias[static_cast<std::size_t>(j)]) : 0.0;
        const toolkit::W8a8Element ref =
            toolkit::w8a8_reference_element(a8, row, wq.view(), j, bj, mma_term, &hw);
        const std::uint16_t bits = out[static_cast<std::size_t>(i * s.n + j)];
        EXPECT_NE(bits, testing::gemm::kPoisonBf16) << "C[" << i << ", " << j << "] unwritten";
        const double got = num::bf16_to_f32(bits);
        if (!(std::fabs(got - ref.value) <= ref.bound)) {
          ADD_FAILURE() << "C[" << i << ", " << j << "] = " << got << ", reference " << ref.value
                        << ", bound " << ref.bound;
          return INFINITY;
        }
        err2 += (got - ref.value) * (got - ref.value);
        ref2 += ref.value * ref.value;
        aware_err2 += (got - ref.aware) * (got - ref.aware);
        aware2 += ref.aware * ref.aware;
      }
    }
    // Against the product the op computes (A and W as cast): its roundings alone, on any shape.
    EXPECT_LE(std::sqrt(aware_err2 / aware2), toolkit::kNormTol);
    const double norm = std::sqrt(err2 / ref2);
    if (s.m * s.n >= toolkit::kE4m3StatMinOutputs && s.m * s.k >= toolkit::kE4m3StatMinActs &&
        s.n * s.k >= toolkit::kE4m3StatMinActs) {
      EXPECT_LE(norm, toolkit::kW8a8RequantTol);
    }
    return norm;
  }
};

TEST_P(W8a8RequantNumerics, MatchesTheFloat64ProductOfThe4BitWeights) {
  // A GPU's FP8 tensor cores: the allowance of tests/ops/fp8_gemm_test.cpp's suite.
  const double mma = GetParam() == "cpu" ? 0.0 : 2 * toolkit::kFp8MmaTerm;
  using enum WeightFormat;
  using enum WeightLayout;
  // N a multiple of 8 (cuBLASLt's FP8 rule for a BF16 D, so the cuda instance runs them), most
  // with a partial 128-block of N.
  for (const Problem& s : {Problem{1, 296, 256, kNvfp4, kRowMajor, false},
                           Problem{5, 136, 320, kMxfp4, kTransposed, true},
                           Problem{32, 128, 1024, kNvfp4, kTransposed, true},
                           Problem{32, 128, 1024, kMxfp4, kRowMajor, false},
                           Problem{150, 136, 160, kNvfp4, kRowMajor, true}}) {
    const double norm = check(s, mma);
    std::cout << "[ NORM     ] M=" << s.m << " N=" << s.n << " K=" << s.k << " "
              << to_string(s.format) << ": " << norm << "\n";
  }
}
INSTANTIATE_TEST_SUITE_P(, W8a8RequantNumerics, ::testing::Values("cpu", "cuda"),
                         testing::gemm::backend_name);

std::unique_ptr<CpuBackend> cpu() {
  return std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
}

TEST(Fp8Requant, TheStatedCostIsWhatTheUploadAllocates) {
  auto b = cpu();
  std::mt19937_64 gen(7);
  const HostQuantWeights hw =
      random_4bit({1, 300, 416, WeightFormat::kNvfp4, WeightLayout::kRowMajor, false}, gen);
  const ops::Fp8RequantCost cost = ops::fp8_requant_cost(hw);
  EXPECT_EQ(cost.source, hw.codes.size() + hw.scales.size());
  const ops::Fp8Weights d = ops::describe_fp8_weights("test", 300, 416);
  EXPECT_EQ(cost.fp8, d.codes_bytes + d.scales_bytes);
  const std::size_t before = b->live_bytes();
  ops::Fp8Weights w = ops::upload_requantized_fp8_weights(*b, hw);
  EXPECT_EQ(b->live_bytes() - before, cost.fp8);
  ops::free_fp8_weights(*b, w);
  EXPECT_EQ(b->live_bytes(), before);
  // A large NVFP4 layer: 1 byte a weight plus its blocks' scales over 0.5625 bytes a weight.
  HostQuantWeights big;
  big.format = WeightFormat::kNvfp4;
  big.n = 8192;
  big.k = 8192;
  EXPECT_NEAR(ops::fp8_requant_cost(big).ratio(), 1.0 / 0.5625, 1e-3);
}

TEST(Fp8Requant, BadWeightsAllocateNothing) {
  auto b = cpu();
  std::mt19937_64 gen(8);
  HostQuantWeights hw =
      random_4bit({1, 4, 64, WeightFormat::kNvfp4, WeightLayout::kRowMajor, false}, gen);
  hw.scales[1] = 0x7F;  // an E4M3 NaN block scale: row 0, k 16..31
  const std::size_t before = b->live_bytes();
  const Error e = testing::expect_error([&] { (void)ops::upload_requantized_fp8_weights(*b, hw); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("requantize_e4m3_block128"));
  EXPECT_THAT(e.what(), HasSubstr("[0, 16] = nan"));
  EXPECT_EQ(b->live_bytes(), before);
  HostQuantWeights ragged;
  ragged.format = WeightFormat::kMxfp4;
  ragged.n = 2;
  ragged.k = 48;  // not a multiple of MXFP4's 32
  const Error cost = testing::expect_error([&] { (void)ops::fp8_requant_cost(ragged); });
  EXPECT_THAT(cost.what(), HasSubstr("[fp8_requant_cost] k = 48 is not a multiple of 32"));
}

TEST(Fp8Requant, AModelScopeReleasesTheResourceAtTeardown) {
  auto owned = cpu();
  CpuBackend& b = *owned;
  const LedgerProbe probe = b.ledger_probe();
  std::mt19937_64 gen(9);
  ModelScope scope(std::move(owned));
  const auto& r = scope.add(ops::make_requantized_fp8_resource(
      b, random_4bit({1, 130, 256, WeightFormat::kMxfp4, WeightLayout::kRowMajor, false}, gen)));
  EXPECT_TRUE(r.weights().codes);
  EXPECT_THAT(b.alloc_report(), HasSubstr("fp8_requant_test.cpp"));
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.clean()) << report.swept << " swept";
  EXPECT_EQ(probe.live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale
