// The repack of NVFP4, MXFP4 and INT4 host weights into the panel layout (kernels/panel_layout.h)
// that the CPU's AVX-512 BF16 kernels read, run once per upload. Codes and scale codes are moved,
// never changed: the layout keeps every weight exactly as the source has it. Padding (N to 32)
// holds code 0 and scale code 0 (FP4) or code 8 (INT4), which add exact zeros.
#pragma once

#include <cstdint>
#include <vector>

#include "metrale/quant.h"

namespace metrale::ops {

// Weights in the panel layout, with the shape and format they were packed from.
struct PackedPanelWeights {
  WeightFormat format = WeightFormat::kNvfp4;
  std::int64_t n = 0, k = 0;         // the source's shape (unpadded)
  std::vector<std::uint8_t> codes;   // panel_layout::code_bytes(n, k) bytes
  std::vector<std::uint8_t> scales;  // panel_layout::scale_bytes(n, k, group) bytes
  float tensor_scale = 1.0f;
};

// w (either format, either layout) in the panel layout. Throws Error(kInvalidArgument,
// "pack_for_panels") naming the bad value for a bad shape or buffer size.
PackedPanelWeights pack_for_panels(const HostQuantWeights& w);

// The codes of INT4 weights w in the panel layout (their side buffer: pack_int4_side). Throws
// Error(kInvalidArgument) naming the bad value for weights int4::check_weights refuses or a K the
// layout does not take.
std::vector<std::uint8_t> pack_int4_codes_for_panels(const HostQuantWeights& w);

// INT4's side buffer (kernels/int4_layout.h) of w: scales and zero points row-major, or in panel
// order (int4_layout::panel_entry) for the panel layout, then the K permutation where w has one,
// zero bytes between. Throws Error(kInvalidArgument) for weights int4::check_weights refuses.
std::vector<std::uint8_t> pack_int4_side(const HostQuantWeights& w, bool panel_order);

}  // namespace metrale::ops
