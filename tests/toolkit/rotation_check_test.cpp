// Every copy of a benchmark's weight rotation is checked before it is timed
// (toolkit/rotation.h, check_rotation): a copy whose upload went wrong is found and named, where
// a check of copy 0 alone (what `metrale bench` did) passes.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "toolkit/random_weights.h"
#include "toolkit/rotation.h"
#include "toolkit/sampled_check.h"

namespace metrale::toolkit {
namespace {

TEST(RotationCheck, AWrongCopyIsFoundWhereCopyZeroAlonePasses) {
  const auto seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr std::int64_t m = 4, n = 64, k = 128;
  constexpr std::size_t kCopies = 4, kBad = 2;
  CpuBackend b(CpuBackendOptions{builtin_host_modules(), 2});
  const HostQuantWeights hw = random_weights(WeightFormat::kNvfp4, n, k, rng);
  std::vector<ops::QuantWeights> copies;
  for (std::size_t r = 0; r < kCopies; ++r) copies.push_back(ops::upload_weights(b, hw));
  // Copy 2's upload went wrong: other weights' codes where its own should be.
  const HostQuantWeights other = random_weights(WeightFormat::kNvfp4, n, k, rng);
  b.copy_h2d(copies[kBad].codes, other.codes.data(), other.codes.size());
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (auto& x : a) x = num::f32_to_bf16(unit(rng));
  const DevicePtr da = b.alloc(a.size() * 2), dc = b.alloc(static_cast<std::size_t>(m * n) * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  std::vector<int> samples_asked;
  const auto check_copy = [&](std::size_t r, int samples) {
    samples_asked.push_back(samples);
    b.memset(dc, 0xFF, static_cast<std::size_t>(m * n) * 2);
    ops::w4a16_gemm(b, b.default_stream(), da, m, copies[r], dc, {});
    std::vector<std::uint16_t> c(static_cast<std::size_t>(m * n));
    b.copy_d2h(c.data(), dc, c.size() * 2);
    return sampled_check(a, c, hw, m, ops::choose_route(b, m, copies[r], {}), rng, samples);
  };
  EXPECT_TRUE(check_rotation(1, check_copy).passed());  // copy 0 alone: the old check
  samples_asked.clear();
  const RotationCheck rc = check_rotation(kCopies, check_copy);
  EXPECT_FALSE(rc.passed()) << rc.str();
  ASSERT_TRUE(rc.failed_copy.has_value());
  EXPECT_EQ(*rc.failed_copy, kBad);
  EXPECT_EQ(rc.copies, kBad + 1);
  EXPECT_TRUE(rc.first.passed());
  EXPECT_NE(rc.str().find("copy 2 WRONG"), std::string::npos) << rc.str();
  EXPECT_EQ(samples_asked, (std::vector<int>{kFirstCopySamples, kCopySamples, kCopySamples}));
  b.free(da);
  b.free(dc);
  for (ops::QuantWeights& w : copies) ops::free_weights(b, w);
  b.op_cache().release(b);
}

TEST(RotationCheck, NoCopiesIsRefused) {
  const Error e = testing::expect_error(
      [] { check_rotation(0, [](std::size_t, int) { return SampledCheck{}; }); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("[check_rotation] 0 copies"), std::string::npos) << e.what();
}

}  // namespace
}  // namespace metrale::toolkit
