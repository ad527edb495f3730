// INT4 weights on the host (metrale/quant.h, Note [INT4 weights]): the checks and element access
// quant.cpp dispatches to for WeightFormat::kInt4. Internal to src/core.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "metrale/quant.h"

namespace metrale::int4 {

// Throws Error(kInvalidArgument, api) unless w is consistent INT4 weights: row-major, a group
// int4_group_ok allows, codes [N, K/2], scales [N, K/group] x 2 bytes, zeros empty or [N, K/group]
// each at most 15, k_perm empty or of K entries that are -1 (padding) or a permutation of
// [0, a_columns), tensor scale 1.
void check_weights(std::string_view api, const HostQuantWeights& w);

// Where W's column k is stored: its position in k_perm (k itself without act order). For
// k_perm's inverse over all of W's columns, stored_columns.
std::int64_t stored_column(const HostQuantWeights& w, std::int64_t k);
// stored_column of every k of [0, a_columns(w)).
std::vector<std::int64_t> stored_columns(const HostQuantWeights& w);

// The code at stored column j of row.
std::uint8_t stored_code(const HostQuantWeights& w, std::int64_t row, std::int64_t j);
// The scale of stored column j's group, as float (exact).
float stored_scale(const HostQuantWeights& w, std::int64_t row, std::int64_t j);
// The zero point of stored column j's group (8 when symmetric).
int stored_zero(const HostQuantWeights& w, std::int64_t row, std::int64_t j);
// (code - zero) x scale at stored column j, exact in a double (and in a float).
double stored_weight(const HostQuantWeights& w, std::int64_t row, std::int64_t j);

// Rows [begin, end) of checked weights (slice_rows' INT4 case): k_perm kept.
HostQuantWeights slice_rows(const HostQuantWeights& w, std::int64_t begin, std::int64_t end);
// Columns [begin, end) at multiples of the group (slice_columns' INT4 case); of act-ordered
// weights, padded to blocks of 32 per group (metrale/quant.h, slice_columns), and
// Error(kInvalidArgument) for weights that are a slice already.
HostQuantWeights slice_columns(const HostQuantWeights& w, std::int64_t begin, std::int64_t end);

}  // namespace metrale::int4
