// The weight rotation of the benchmarks (toolkit/rotation.h): enough copies that 512 MiB lie
// between two reads of the same bytes, at most 64, at least 1.
#include "toolkit/rotation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/expect_error.h"
#include "metrale/error.h"

namespace metrale::toolkit {
namespace {

TEST(Rotation, CopiesFillTheRotationBytesUpToTheCap) {
  // Llama-3-8B's o projection, NVFP4: 8 MiB of codes and 1 MiB of scales.
  EXPECT_EQ(rotation_copies((std::size_t{9} << 20)), 57u);
  EXPECT_EQ(rotation_copies(kRotationBytes / 2), 3u);
  EXPECT_EQ(rotation_copies(kRotationBytes), 2u);
  // A block larger than the rotation is read once per turn anyway.
  EXPECT_EQ(rotation_copies(kRotationBytes + 1), 1u);
  EXPECT_EQ(rotation_copies(std::size_t{4} << 30), 1u);
  // A block of a few kilobytes (the CLI tests) is capped.
  EXPECT_EQ(rotation_copies(4096), kMaxRotationCopies);
  EXPECT_EQ(rotation_copies(1), kMaxRotationCopies);
}

TEST(Rotation, AnEmptyBlockIsRefused) {
  const Error e = testing::expect_error([] { rotation_copies(0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), ::testing::HasSubstr("[rotation_copies] a block of 0 bytes"));
}

}  // namespace
}  // namespace metrale::toolkit
