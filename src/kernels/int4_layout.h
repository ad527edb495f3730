// Where INT4 weights keep their side data on a device (Note [INT4 weights]): the `scales` buffer
// of QuantWeights holds the group scales [N, K/group] (BF16 or FP16, 2 bytes each), then the zero
// points [N, K/group] (one byte each; asymmetric weights only), then, 16-byte aligned, the act
// order's K permutation (int32 [K]; act-ordered weights only). One buffer, so INT4 weights upload,
// check and free as the FP4 formats' two buffers do. In the panel layout (kGemmPanels) the scales'
// and the zero points' [N, K/group] entries are in panel order (panel_entry), not row-major. Host
// and device code alike.
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

// Rows per panel in the panel order: the panel layout's 32 columns of C (kernels/panel_layout.h).
inline constexpr std::int64_t kPanelRows = 32;

// Where entry [row, g] of the [N, groups] scales (or zero points) lies in the panel order: by
// panel of 32 rows, then group, then row in the panel (the last panel as wide as N leaves it), so
// that a panel's scales of one group are contiguous. The kernels scale a block's sums per group
// for 32 columns at once; read row-major those were 32 rows of a few bytes each, transposed per
// panel (docs/PERF.md, "Act order across ranks"). A permutation of [0, N x groups).
METRALE_HD constexpr std::uint64_t panel_entry(std::int64_t n, std::int64_t groups,
                                               std::int64_t row, std::int64_t g) {
  const std::int64_t p0 = row / kPanelRows * kPanelRows;
  const std::int64_t width = n - p0 < kPanelRows ? n - p0 : kPanelRows;
  return static_cast<std::uint64_t>(p0 * groups + g * width + (row - p0));
}

}  // namespace metrale::int4_layout
