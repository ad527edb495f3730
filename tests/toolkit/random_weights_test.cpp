// The benchmarks' random quantized weights (toolkit/random_weights.h): the shape and sizes of the
// format, every block scale (tensor scale included) in [2^-9, 2^-3) for both formats, all six
// octaves drawn, and bad shapes refused.
#include "toolkit/random_weights.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "core/expect_error.h"
#include "metrale/error.h"

namespace metrale::toolkit {
namespace {

TEST(RandomWeights, BothFormatsDrawScalesOverTheSameSixOctaves) {
  std::mt19937_64 rng(7);
  for (const WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    SCOPED_TRACE(std::string(to_string(format)));
    const std::int64_t n = 48, k = 256;
    const HostQuantWeights w = random_weights(format, n, k, rng);
    EXPECT_EQ(w.format, format);
    EXPECT_EQ(w.layout, WeightLayout::kRowMajor);
    EXPECT_EQ(w.n, n);
    EXPECT_EQ(w.k, k);
    ASSERT_EQ(w.codes.size(), static_cast<std::size_t>(n * k / 2));
    ASSERT_EQ(w.scales.size(), static_cast<std::size_t>(n * k / group_size(format)));
    std::set<int> octaves;
    for (std::int64_t r = 0; r < n; ++r) {
      for (std::int64_t c = 0; c < k; c += group_size(format)) {
        const float s = w.scale(r, c);
        ASSERT_GE(s, std::ldexp(1.0f, -9)) << r << ", " << c;
        ASSERT_LT(s, std::ldexp(1.0f, -3)) << r << ", " << c;
        octaves.insert(static_cast<int>(std::floor(std::log2(s))));
      }
    }
    EXPECT_EQ(octaves.size(), 6u);
    // Random codes: both nibbles take many values.
    std::set<int> low, high;
    for (const std::uint8_t b : w.codes) {
      low.insert(b & 0xF);
      high.insert(b >> 4);
    }
    EXPECT_EQ(low.size(), 16u);
    EXPECT_EQ(high.size(), 16u);
  }
}

TEST(RandomWeights, ShapesTheFormatCannotHoldAreRefused) {
  std::mt19937_64 rng(1);
  for (const auto& [format, n, k] :
       {std::tuple{WeightFormat::kNvfp4, 16, 24}, std::tuple{WeightFormat::kMxfp4, 16, 48},
        std::tuple{WeightFormat::kNvfp4, 0, 64}, std::tuple{WeightFormat::kMxfp4, 4, 0}}) {
    const Error e = testing::expect_error([&] { random_weights(format, n, k, rng); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), ::testing::HasSubstr(fmt::format("[random_weights] {} weights of {} x {}",
                                                           to_string(format), n, k)));
  }
}

}  // namespace
}  // namespace metrale::toolkit
