#include "toolkit/rotation.h"

#include <fmt/format.h>

#include <algorithm>

#include "metrale/error.h"

namespace metrale::toolkit {

std::size_t rotation_copies(std::size_t block_bytes) {
  if (block_bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "rotation_copies", "a block of 0 bytes");
  }
  return std::min(kMaxRotationCopies, kRotationBytes / block_bytes + 1);
}

std::string RotationCheck::str() const {
  std::string s = fmt::format("copy 0: {}; {} copies checked", first.str(), copies);
  if (failed_copy) s += fmt::format("; copy {} WRONG: {}", *failed_copy, failed.str());
  return s;
}

RotationCheck check_rotation(
    std::size_t copies, const std::function<SampledCheck(std::size_t r, int samples)>& check_copy) {
  if (copies == 0) throw Error(ErrorCode::kInvalidArgument, "check_rotation", "0 copies");
  RotationCheck rc;
  for (std::size_t r = 0; r < copies; ++r) {
    const SampledCheck c = check_copy(r, r == 0 ? kFirstCopySamples : kCopySamples);
    if (r == 0) rc.first = c;
    rc.copies = r + 1;
    if (!c.passed()) {
      rc.failed_copy = r;
      rc.failed = c;
      break;
    }
  }
  return rc;
}

}  // namespace metrale::toolkit
