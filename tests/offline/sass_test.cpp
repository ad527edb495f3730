// The SASS reader (sass.h) on small hand-written listings: parsing, loops, and the steady path.
#include <gtest/gtest.h>

#include "sass.h"

namespace {

namespace sass = metrale::offline::sass;

TEST(SassReader, Placeholder) {
  SUCCEED();
}

}  // namespace
