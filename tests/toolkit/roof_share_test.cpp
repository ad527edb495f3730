// What a benchmark prints against its roofs (toolkit/roof_share.h): the highest reading is the
// roof, a share above it is marked, and a time below the timer's resolution or a block that was
// not timed prints what was measured, never inf or nan.
#include "toolkit/roof_share.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace metrale::toolkit {
namespace {

TEST(RoofShare, TheRoofIsTheHighestReading) {
  RoofReadings r;
  EXPECT_EQ(r.highest(), 0);
  for (const double x : {5.0, 9.0, 0.0, -1.0, std::nan(""), 7.0}) r.add(x);
  EXPECT_EQ(r.highest(), 9.0);
  EXPECT_EQ(r.count(), 3);  // not measured (≤ 0, nan) is no reading
}

TEST(RoofShare, AShareAboveTheRoofIsMarked) {
  EXPECT_EQ(format_share(roof_share(87.0, 100.0)), "87%");
  const RoofShare above = roof_share(113.0, 100.0);
  EXPECT_TRUE(above.above);
  EXPECT_EQ(format_share(above), "113%!");
  EXPECT_FALSE(roof_share(100.0, 100.0).above);
  // An unknown roof or rate is no share, never inf or nan.
  EXPECT_EQ(roof_share(5.0, 0.0).pct, 0);
  EXPECT_EQ(roof_share(std::numeric_limits<double>::infinity(), 1.0).pct, 0);
}

TEST(RoofShare, SubMicrosecondTimesPrintWhatWasMeasured) {
  EXPECT_EQ(format_ms(1.5e-3), "1.500");
  EXPECT_EQ(format_ms(3.5e-7), "350 ns");
  EXPECT_EQ(format_ms(0.0), "< 1 µs");
  EXPECT_EQ(format_tokens_per_s(16, 2e-3, true), "8000.0");
  EXPECT_EQ(format_tokens_per_s(16, 0.0, true), "> 16000000.0");
  EXPECT_EQ(format_tokens_per_s(16, 0.0, false), "not timed");
  for (const double s : {0.0, 3e-7, 1e-3}) {
    for (const bool timed : {true, false}) {
      const std::string t = format_tokens_per_s(1, s, timed) + format_ms(s);
      EXPECT_EQ(t.find("inf"), std::string::npos) << t;
      EXPECT_EQ(t.find("nan"), std::string::npos) << t;
    }
  }
  EXPECT_FALSE(tokens_per_s(16, 0.0).has_value());
  EXPECT_EQ(tokens_per_s(16, 2e-3).value(), 8000.0);
}

}  // namespace
}  // namespace metrale::toolkit
