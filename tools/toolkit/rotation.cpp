#include "toolkit/rotation.h"

#include <algorithm>

#include "metrale/error.h"

namespace metrale::toolkit {

std::size_t rotation_copies(std::size_t block_bytes) {
  if (block_bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "rotation_copies", "a block of 0 bytes");
  }
  return std::min(kMaxRotationCopies, kRotationBytes / block_bytes + 1);
}

}  // namespace metrale::toolkit
