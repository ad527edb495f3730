// The block size a launch takes from the kernel it launches: every op sizes its blocks from the
// kernel's published `<entry>_block_threads`, never from a number assumed at the call; and the
// wave a grid sized by occupancy takes, from its `<entry>_blocks_per_sm`.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string_view>

#include "metrale/backend.h"
#include "metrale/error.h"

namespace metrale::ops {

// Split-K: at most this many K slices (each slice adds an M x N FP32 plane to the workspace and
// to the reduction's reads), in the dense and the grouped op alike.
inline constexpr std::int64_t kMaxSplits = 16;

// The block k publishes; Error(kNotFound) naming api and the kernel when it publishes none (a
// kernel's tile is strided by the block it was written for, so another size would skip or repeat
// elements).
inline Dim3 published_block(std::string_view api, const Backend& backend, const ResolvedKernel& k) {
  if (k.meta.block_threads == 0) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} publishes no block size (its <entry>_block_threads symbol is "
                            "missing or 0); a launcher cannot assume one",
                            backend.kernel_name(k)));
  }
  return Dim3{k.meta.block_threads};
}

// One wave of k: the blocks all SMs hold at once, sm_count x the blocks per SM k publishes
// (<entry>_blocks_per_sm). Error(kNotFound) naming api and the kernel when it publishes none: a
// split-K or persistent grid sized from an assumed occupancy leaves SMs idle or queues a tail.
inline std::int64_t wave_blocks(std::string_view api, const Backend& backend,
                                const ResolvedKernel& k) {
  if (k.meta.blocks_per_sm == 0) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} publishes no blocks per SM (its <entry>_blocks_per_sm symbol is "
                            "missing or 0), which a split-K or persistent grid is sized by",
                            backend.kernel_name(k)));
  }
  return std::int64_t{k.meta.blocks_per_sm} * std::max(backend.sm_count(), 1u);
}

}  // namespace metrale::ops
