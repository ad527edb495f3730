// The CPU backend's dense GEMMs through Backend::plan_dense_gemm / run_dense_gemm: BF16 against
// a float64 reference (normalized error and a per-element bound, output poisoned first), the
// buffer checks the base class makes before any kernel runs, and a kind whose kernel the
// backend's modules lack.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/numerics.h"
#include "support/bias_rounding.h"
#include "support/random.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/gemm_tolerance.h"

namespace metrale {
namespace {

using testing::expect_error;
using testing::random_bf16;
using testing::rng;

constexpr std::uint16_t kPoison = 0x7FC1;  // a BF16 NaN no GEMM writes

struct Buffers {
  CpuBackend& be;
  DevicePtr a, b, c, bias;
  std::int64_t m, n, k;
  Buffers(CpuBackend& backend, std::int64_t m_, std::int64_t n_, std::int64_t k_)
      : be(backend), m(m_), n(n_), k(k_) {
    a = be.alloc(static_cast<std::size_t>(m * k * 2));
    b = be.alloc(static_cast<std::size_t>(n * k * 2));
    c = be.alloc(static_cast<std::size_t>(m * n * 2));
    bias = be.alloc(static_cast<std::size_t>(n * 2));
  }
  ~Buffers() {
    for (DevicePtr p : {a, b, c, bias}) be.free(p);
  }
};

TEST(CpuDenseGemm, Bf16MatchesTheFloat64Reference) {
  CpuBackend be;
  EXPECT_EQ(be.dense_gemm_unavailable(DenseKind::kBf16), "");
  struct Case {
    std::int64_t m, n, k;
  };
  for (const Case s : {Case{1, 1, 1}, Case{3, 70, 37}, Case{17, 129, 256}, Case{64, 200, 96}}) {
    for (const bool with_bias : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "M=" << s.m << " N=" << s.n << " K=" << s.k << " bias=" << with_bias);
      Buffers buf(be, s.m, s.n, s.k);
      const auto ha = random_bf16(static_cast<std::size_t>(s.m * s.k)),
                 hb = random_bf16(static_cast<std::size_t>(s.n * s.k)),
                 hbias = random_bf16(static_cast<std::size_t>(s.n));
      be.copy_h2d(buf.a, ha.data(), ha.size() * 2);
      be.copy_h2d(buf.b, hb.data(), hb.size() * 2);
      be.copy_h2d(buf.bias, hbias.data(), hbias.size() * 2);
      std::vector<std::uint16_t> out(static_cast<std::size_t>(s.m * s.n), kPoison);
      be.copy_h2d(buf.c, out.data(), out.size() * 2);

      const DenseGemmPlan plan =
          be.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, s.m, s.n, s.k, with_bias});
      EXPECT_EQ(plan.workspace_bytes, 0u);
      DenseGemmArgs args;
      args.a = buf.a;
      args.b = buf.b;
      args.c = buf.c;
      if (with_bias) args.bias = buf.bias;
      be.run_dense_gemm(plan, args, be.default_stream());
      be.copy_d2h(out.data(), buf.c, out.size() * 2);

      double err2 = 0, ref2 = 0;
      for (std::int64_t i = 0; i < s.m; ++i) {
        for (std::int64_t j = 0; j < s.n; ++j) {
          double ref = with_bias ? num::bf16_to_f32(hbias[static_cast<std::size_t>(j)]) : 0.0;
          double abs_sum = std::fabs(ref);
          for (std::int64_t q = 0; q < s.k; ++q) {
            const double p =
                static_cast<double>(num::bf16_to_f32(ha[static_cast<std::size_t>(i * s.k + q)])) *
                num::bf16_to_f32(hb[static_cast<std::size_t>(j * s.k + q)]);
            ref += p;
            abs_sum += std::fabs(p);
          }
          const std::uint16_t got_bits = out[static_cast<std::size_t>(i * s.n + j)];
          ASSERT_NE(got_bits, kPoison) << "C[" << i << ", " << j << "] was not written";
          const double got = num::bf16_to_f32(got_bits);
          ASSERT_LE(std::fabs(got - ref),
                    toolkit::element_bound(ref, abs_sum, s.k, toolkit::AMode::kBf16))
              << "C[" << i << ", " << j << "] = " << got << ", reference " << ref;
          err2 += (got - ref) * (got - ref);
          ref2 += ref * ref;
        }
      }
      ASSERT_GT(ref2, 0.0);
      EXPECT_LE(std::sqrt(err2 / ref2), toolkit::kNormTol);
    }
  }
}

// The CPU's BF16 GEMM rounds once with a bias (RNE(P + bias), tests/support/bias_rounding.h), at
// any N; and the classification itself, shown failing on a planted fault (one bias 64 off),
// so the GPU test's counts can be trusted.
TEST(CpuDenseGemm, Bf16BiasRoundsOnce) {
  CpuBackend be;
  for (const std::int64_t n : {256, 257, 63}) {
    const testing::BiasRoundingCase c = testing::bias_rounding_case(rng(), 128, n);
    Buffers buf(be, c.m, c.n, c.k);
    be.copy_h2d(buf.a, c.a.data(), c.a.size() * 2);
    be.copy_h2d(buf.b, c.b.data(), c.b.size() * 2);
    be.copy_h2d(buf.bias, c.bias.data(), c.bias.size() * 2);
    std::vector<std::uint16_t> out(static_cast<std::size_t>(c.m * c.n), kPoison);
    be.copy_h2d(buf.c, out.data(), out.size() * 2);
    DenseGemmArgs args;
    args.a = buf.a;
    args.b = buf.b;
    args.c = buf.c;
    args.bias = buf.bias;
    be.run_dense_gemm(be.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, c.m, c.n, c.k, true}),
                      args, be.default_stream());
    be.copy_d2h(out.data(), buf.c, out.size() * 2);
    const testing::BiasRoundingCounts counts = testing::classify_bias_rounding(c, out);
    EXPECT_EQ(counts.twice, 0) << "N=" << n << ": " << counts.str();
    EXPECT_EQ(counts.neither, 0) << "N=" << n << ": " << counts.str();
    EXPECT_GT(counts.once, 0) << "N=" << n << ": no element told the two apart";
    testing::BiasRoundingCase planted = c;
    planted.bias[0] = num::f32_to_bf16(num::bf16_to_f32(planted.bias[0]) + 64.0f);
    EXPECT_GT(testing::classify_bias_rounding(planted, out).neither, 0) << "N=" << n;
    // And a GEMM that rounded twice is told apart: C made so, element by element.
    std::vector<std::uint16_t> twice(out.size());
    for (std::int64_t i = 0; i < c.m; ++i)
      for (std::int64_t j = 0; j < c.n; ++j)
        twice[static_cast<std::size_t>(i * c.n + j)] = testing::rounded_twice(c, i, j);
    const testing::BiasRoundingCounts seen = testing::classify_bias_rounding(c, twice);
    EXPECT_EQ(seen.once, 0);
    EXPECT_EQ(seen.twice, counts.once) << seen.str();
  }
}

TEST(CpuDenseGemm, RefusesBadBuffersBeforeAnythingRuns) {
  CpuBackend be;
  Buffers buf(be, 4, 32, 64);
  const DenseGemmPlan plan = be.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, 4, 32, 64});
  DenseGemmArgs ok;
  ok.a = buf.a;
  ok.b = buf.b;
  ok.c = buf.c;
  const auto refuse = [&](DenseGemmArgs args, const char* words) {
    const Error e = expect_error([&] { be.run_dense_gemm(plan, args, be.default_stream()); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("[run_dense_gemm]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  };
  DenseGemmArgs x = ok;
  x.a = DevicePtr{};
  refuse(x, "A is null");
  x = ok;
  x.b = buf.b.offset(2);
  refuse(x, "B = 0x");
  x = ok;
  x.c = buf.a;  // C over A
  refuse(x, "overlaps A");
  x = ok;
  x.bias = buf.bias;
  refuse(x, "made without one");
  x = ok;
  x.a_scales = buf.bias;
  refuse(x, "takes none");
  x = ok;
  x.c = buf.c.offset(16);  // C's 4 x 32 x 2 bytes from 16 bytes into its own allocation
  refuse(x, "overruns");

  const Error shape = expect_error([&] {
    (void)be.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, 0, 32, 64});
  });
  EXPECT_EQ(shape.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(shape.what()).find("M=0"), std::string::npos) << shape.what();
}

TEST(CpuDenseGemm, AKindWithoutItsKernelIsUnavailable) {
  CpuBackendOptions options;
  options.modules.clear();  // no "blas" module at all
  CpuBackend be(std::move(options));
  const std::string why = be.dense_gemm_unavailable(DenseKind::kBf16);
  EXPECT_NE(why.find("blas::gemm_bf16"), std::string::npos) << why;
  const Error e = expect_error([&] {
    (void)be.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, 1, 1, 1});
  });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_NE(std::string(e.what()).find("blas::gemm_bf16"), std::string::npos) << e.what();
}

}  // namespace
}  // namespace metrale
