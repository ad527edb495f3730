#include <gtest/gtest.h>
#include "metrale/error.h"
TEST(Smoke, ErrorMessageStartsWithApi) {
  metrale::Error e(metrale::ErrorCode::kInvalidArgument, "alloc", "bytes = 0");
  EXPECT_STREQ(e.what(), "[alloc] bytes = 0");
}
