// The INT4 side buffer's panel order (kernels/int4_layout.h, panel_entry): every [row, group]
// entry lands once in [0, N x groups), and one panel's rows of one group lie side by side, the
// last panel as wide as N leaves it.
#include "kernels/int4_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace metrale::int4_layout {
namespace {

TEST(Int4PanelOrder, EveryEntryLandsOnceAndAPanelsGroupIsContiguous) {
  for (const std::int64_t n : {1, 16, 31, 32, 33, 70, 96}) {
    for (const std::int64_t groups : {1, 3, 8}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " groups " << groups);
      std::vector<int> seen(static_cast<std::size_t>(n * groups), 0);
      for (std::int64_t row = 0; row < n; ++row) {
        for (std::int64_t g = 0; g < groups; ++g) {
          const std::uint64_t at = panel_entry(n, groups, row, g);
          ASSERT_LT(at, seen.size());
          ++seen[at];
          if (row % kPanelRows != 0) {
            EXPECT_EQ(at, panel_entry(n, groups, row - 1, g) + 1) << row << ", " << g;
          }
        }
      }
      for (const int count : seen) ASSERT_EQ(count, 1);
    }
  }
}

}  // namespace
}  // namespace metrale::int4_layout
