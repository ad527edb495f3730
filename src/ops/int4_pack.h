// The repack of INT4 host weights into the INT4 decode layout (kernels/int4_decode_layout.h) that
// gemm_int4_decode and dequant_int4_bf16 read, run once per upload. Padding (N to 32 rows, K to
// 128) holds code 0 under scale 0, so it adds exact zeros whatever its zero point.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "metrale/quant.h"

namespace metrale::ops {

// INT4 weights in the decode layout, with the description they were packed from.
struct PackedInt4Weights {
  std::int64_t n = 0, k = 0, group = 0;
  bool fp16_scales = false, zero_points = false, act_order = false;
  std::vector<std::uint8_t> codes;  // int4_decode::sizes_of(...).codes bytes
  std::vector<std::uint8_t> side;   // scales, zero points per tile block; then the permutation
};

// Whether INT4 weights in groups of `group` have a decode layout (int4_decode::group_ok).
bool int4_decode_layout_ok(std::int64_t group) noexcept;

// w (INT4, row-major) in the INT4 decode layout. Throws Error(kInvalidArgument, api) naming the
// bad value for weights int4::check_weights refuses or a group the layout does not take.
PackedInt4Weights pack_int4_for_decode(const HostQuantWeights& w,
                                       std::string_view api = "pack_int4_for_decode");

// Stored W[n, j] as the kernels compute it from p's buffers (int4_decode::weight).
float packed_int4_weight(const PackedInt4Weights& p, std::int64_t n, std::int64_t j);

}  // namespace metrale::ops
