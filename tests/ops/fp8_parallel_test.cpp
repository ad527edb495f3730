// The W8A8 op's pieces for tensor parallelism, in one process: FP32 output
// (Fp8GemmOptions::out_f32) on every backend of the numerics suite, and the 128-block slices of
// E4M3 weights (ops/fp8_slices.h) — a column shard's GEMM is the whole layer's columns bit for
// bit, a row shard's FP32 partials sum to the whole layer's within FP32 rounding, and a cut
// inside a block is refused by name. The ranks themselves: tests/comm/ranks_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/fp8_slices.h"
#include "ops/gemm_reference.h"
#include "support/fp8_reference.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using testing::rng;
namespace f8 = testing::fp8;

std::vector<std::uint16_t> random_a(std::size_t count, std::mt19937_64& gen) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> v(count);
  for (auto& x : v) x = num::f32_to_bf16(u(gen));
  return v;
}

// The numerics suite's instances ("cpu", "cuda"; gpu.ops_numerics_suite runs the "/cuda" ones).
class W8a8OutF32 : public testing::gemm::W8a8BackendTest {};

// FP32 C is the sum (and bias) the BF16 C rounds: rounding it gives the BF16 C bit for bit, and
// every element is written (C is NaN first). N and K within cuBLAS's FP8 rules (N % 8, K % 16),
// M = 1 and 5 padded to 4 rows on CUDA.
TEST_P(W8a8OutF32, IsTheSumTheBf16OutputRoundsOnce) {
  for (const auto& [m, n, k, with_bias] :
       {std::tuple{1, 296, 208, false}, std::tuple{5, 136, 304, true},
        std::tuple{64, 256, 384, true}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << m << " N=" << n << " K=" << k);
    const f8::HostFp8Weights hw = f8::random_weights(n, k, gen());
    ops::Fp8Weights w = ops::upload_fp8_weights(b(), hw.codes, hw.scale_bytes(), n, k);
    const std::vector<std::uint16_t> a = random_a(static_cast<std::size_t>(m * k), gen());
    const std::vector<std::uint16_t> bias =
        random_a(with_bias ? static_cast<std::size_t>(n) : 0, gen());
    const auto mn = static_cast<std::size_t>(m * n);
    const DevicePtr da = alloc(a.size() * 2), c16 = alloc(mn * 2), c32 = alloc(mn * 4);
    const DevicePtr db = with_bias ? alloc(bias.size() * 2) : DevicePtr{};
    b().copy_h2d(da, a.data(), a.size() * 2);
    if (with_bias) b().copy_h2d(db, bias.data(), bias.size() * 2);
    b().memset(c32, 0xFF, mn * 4);
    ops::Fp8GemmOptions o;
    o.bias = db;
    const ops::Fp8GemmPlan p16 = ops::plan(b(), m, w, o);
    o.out_f32 = true;
    const ops::Fp8GemmPlan p32 = ops::plan(b(), m, w, o);
    EXPECT_THAT(p32.describe(), HasSubstr("FP32 C"));
    ops::run(p16, stream(), da, w, c16, ops::scratch_workspace(p16, stream()), db);
    ops::run(p32, stream(), da, w, c32, ops::scratch_workspace(p32, stream()), db);
    b().synchronize(stream());
    std::vector<std::uint16_t> out16(mn);
    std::vector<float> out32(mn);
    b().copy_d2h(out16.data(), c16, mn * 2);
    b().copy_d2h(out32.data(), c32, mn * 4);
    for (std::size_t i = 0; i < mn; ++i) {
      ASSERT_FALSE(std::isnan(out32[i])) << "element " << i << " unwritten";
      ASSERT_EQ(num::f32_to_bf16(out32[i]), out16[i]) << "element " << i;
    }
    // C sized for BF16 is refused before anything runs.
    const Error e = expect_error(
        [&] { ops::run(p32, stream(), da, w, c16, ops::scratch_workspace(p32, stream()), db); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    ops::free_fp8_weights(b(), w);
  }
}
INSTANTIATE_TEST_SUITE_P(, W8a8OutF32, ::testing::Values("cpu", "cuda"),
                         testing::gemm::backend_name);

// C = A · Wᵀ of uploaded host weights on the CPU backend: BF16, or FP32 with out_f32.
template <class T>
std::vector<T> gemm(CpuBackend& be, const std::vector<std::uint16_t>& a, std::int64_t m,
                    const std::vector<std::uint8_t>& codes, const std::vector<std::uint8_t>& scales,
                    std::int64_t n, std::int64_t k) {
  ops::Fp8Weights w = ops::upload_fp8_weights(be, codes, scales, n, k);
  const DevicePtr da = be.alloc(a.size() * 2), dc = be.alloc(static_cast<std::size_t>(m * n) * 4);
  be.copy_h2d(da, a.data(), a.size() * 2);
  ops::Fp8GemmOptions o;
  o.out_f32 = sizeof(T) == 4;
  const ops::Fp8GemmPlan p = ops::plan(be, m, w, o);
  ops::run(p, be.default_stream(), da, w, dc, ops::scratch_workspace(p, be.default_stream()));
  std::vector<T> c(static_cast<std::size_t>(m * n));
  be.copy_d2h(c.data(), dc, c.size() * sizeof(T));
  be.free(da);
  be.free(dc);
  ops::free_fp8_weights(be, w);
  return c;
}

// Columns [k0, k1) of each row of A [m, k].
std::vector<std::uint16_t> columns(const std::vector<std::uint16_t>& a, std::int64_t m,
                                   std::int64_t k, std::int64_t k0, std::int64_t k1) {
  std::vector<std::uint16_t> out;
  for (std::int64_t r = 0; r < m; ++r)
    out.insert(out.end(), a.begin() + r * k + k0, a.begin() + r * k + k1);
  return out;
}

TEST(Fp8Slices, ColumnShardsAreTheWholeLayersColumnsBitForBit) {
  CpuBackend be;
  const std::int64_t m = 3, n = 300, k = 200;  // shards [0, 128), [128, 256), [256, 300)
  const f8::HostFp8Weights hw = f8::random_weights(n, k, rng());
  const std::vector<std::uint16_t> a = random_a(static_cast<std::size_t>(m * k), rng());
  const auto whole = gemm<std::uint16_t>(be, a, m, hw.codes, hw.scale_bytes(), n, k);
  for (const auto& [n0, n1] : {std::pair{0, 128}, std::pair{128, 256}, std::pair{256, 300}}) {
    const ops::HostFp8Weights s = ops::slice_fp8_rows(hw.codes, hw.scale_bytes(), n, k, n0, n1);
    ASSERT_EQ(s.n, n1 - n0);
    const auto part = gemm<std::uint16_t>(be, a, m, s.codes, s.scales, s.n, s.k);
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < s.n; ++j) {
        ASSERT_EQ(part[static_cast<std::size_t>(i * s.n + j)],
                  whole[static_cast<std::size_t>(i * n + n0 + j)])
            << "rows [" << n0 << ", " << n1 << "), C[" << i << ", " << j << "]";
      }
    }
  }
  be.op_cache().release(be);  // the ops' scratch
}

// Each K shard casts its own whole 128-blocks of A as one rank does, so the shards' FP32 partials
// are the same block sums; their total differs from the whole layer's only by the order of the
// block additions (one FP32 rounding a block, each at most 2^-24 of the running magnitude).
TEST(Fp8Slices, RowShardPartialsSumToTheWholeLayer) {
  CpuBackend be;
  const std::int64_t m = 4, n = 130, k = 600;  // shards [0, 256), [256, 512), [512, 600)
  const f8::HostFp8Weights hw = f8::random_weights(n, k, rng());
  const std::vector<std::uint16_t> a = random_a(static_cast<std::size_t>(m * k), rng());
  const auto whole = gemm<float>(be, a, m, hw.codes, hw.scale_bytes(), n, k);
  std::vector<float> total(whole.size(), 0.0f);
  std::vector<double> magnitude(whole.size(), 0.0);
  const f8::CastA cast = f8::cast_a(a, m, k);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t q = 0; q < k; ++q)
        magnitude[static_cast<std::size_t>(i * n + j)] +=
            std::fabs(cast.value[static_cast<std::size_t>(i * k + q)] * hw.at(j, q));
  for (const auto& [k0, k1] : {std::pair{0, 256}, std::pair{256, 512}, std::pair{512, 600}}) {
    const ops::HostFp8Weights s = ops::slice_fp8_columns(hw.codes, hw.scale_bytes(), n, k, k0, k1);
    ASSERT_EQ(s.k, k1 - k0);
    const auto part = gemm<float>(be, columns(a, m, k, k0, k1), m, s.codes, s.scales, n, s.k);
    for (std::size_t i = 0; i < total.size(); ++i) total[i] += part[i];
  }
  const double blocks = static_cast<double>(f8::blocks(k));
  for (std::size_t i = 0; i < total.size(); ++i) {
    const double bound = 2 * (blocks + 3) * std::ldexp(magnitude[i], -24) + 1e-30;
    ASSERT_LE(std::fabs(double{total[i]} - whole[i]), bound) << "element " << i;
  }
  be.op_cache().release(be);
}

TEST(Fp8Slices, ACutInsideABlockOrBadSizesAreRefusedByName) {
  const std::int64_t n = 300, k = 200;
  const f8::HostFp8Weights hw = f8::random_weights(n, k, rng());
  const std::vector<std::uint8_t> sb = hw.scale_bytes();
  const auto refused = [](auto&& f, const std::string& what) {
    const Error e = expect_error(f);
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr(what));
  };
  refused([&] { (void)ops::slice_fp8_columns(hw.codes, sb, n, k, 0, 100); },
          "[slice_fp8_columns] K edge 100 is inside a 128-block");
  refused([&] { (void)ops::slice_fp8_rows(hw.codes, sb, n, k, 64, 300); },
          "[slice_fp8_rows] N edge 64 is inside a 128-block");
  refused([&] { (void)ops::slice_fp8_rows(hw.codes, sb, n, k, 128, 128); },
          "N range [128, 128) is not a non-empty range inside [0, 300)");
  refused([&] { (void)ops::slice_fp8_columns(hw.codes, sb, n, k, 128, 256); },
          "K range [128, 256) is not a non-empty range inside [0, 200)");
  const std::vector<std::uint8_t> short_codes(hw.codes.begin(), hw.codes.end() - 1);
  refused([&] { (void)ops::slice_fp8_rows(short_codes, sb, n, k, 0, 128); },
          "the codes are 59999 bytes; E4M3 300x200 needs 60000");
  const std::vector<std::uint8_t> short_scales(sb.begin(), sb.end() - 4);
  refused([&] { (void)ops::slice_fp8_columns(hw.codes, short_scales, n, k, 0, 128); },
          "the scales are 20 bytes; 300x200 has 6 blocks of 128 x 128, 24 bytes");
}

}  // namespace
}  // namespace metrale
