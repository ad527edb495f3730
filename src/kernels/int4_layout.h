// Where INT4 weights keep their side data on a device (Note [INT4 weights]): the `scales` buffer
// of QuantWeights holds the group scales [N, K/group] (BF16 or FP16, 2 bytes each), then the zero
// points [N, K/group] (one byte each; asymmetric weights only), then, 16-byte aligned, the act
// order's K permutation (int32 [K]; act-ordered weights only). One buffer, so INT4 weights upload,
// check and free as the FP4 formats' two buffers do. Host and device code alike.
#pragma once

#include <cstdint>

#include "metrale/numerics.h"  // METRALE_HD

namespace metrale::int4_layout {

// Byte offsets and the total of the side buffer of N x K weights in groups of `group`.
struct Side {
  std::uint64_t scales = 0, zeros = 0, perm = 0, bytes = 0;
};

METRALE_HD constexpr Side side_of(std::int64_t n, std::int64_t k, std::int64_t group,
                                  bool zero_points, bool act_order) {
  const auto entries = static_cast<std::uint64_t>(n) * static_cast<std::uint64_t>(k / group);
  Side s;
  s.zeros = 2 * entries;
  const std::uint64_t end = s.zeros + (zero_points ? entries : 0);
  s.perm = (end + 15) / 16 * 16;
  s.bytes = act_order ? s.perm + 4 * static_cast<std::uint64_t>(k) : end;
  return s;
}

}  // namespace metrale::int4_layout
