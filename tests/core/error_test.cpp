// An Error keeps its parts as data: the code, the call that failed and the message, besides the
// "[api] message" text people read.
#include "metrale/error.h"

#include <gtest/gtest.h>

#include <string>

namespace metrale {
namespace {

TEST(Error, KeepsTheCallAndTheMessageApartFromTheText) {
  const Error e(ErrorCode::kUnavailable, "cuda", "CUDA unavailable: no CUDA device");
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_EQ(e.api(), "cuda");
  EXPECT_EQ(e.message(), "CUDA unavailable: no CUDA device");
  EXPECT_STREQ(e.what(), "[cuda] CUDA unavailable: no CUDA device");
}

TEST(Error, ACopyKeepsEveryPart) {
  const Error original(ErrorCode::kIo, "safetensors", "truncated header");
  const Error copy = original;  // NOLINT(performance-unnecessary-copy-initialization)
  EXPECT_EQ(copy.code(), ErrorCode::kIo);
  EXPECT_EQ(copy.api(), "safetensors");
  EXPECT_EQ(copy.message(), "truncated header");
  EXPECT_STREQ(copy.what(), original.what());
}

}  // namespace
}  // namespace metrale
