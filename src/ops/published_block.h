// The block size a launch takes from the kernel it launches: every op sizes its blocks from the
// kernel's published `<entry>_block_threads`, never from a number assumed at the call.
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "metrale/backend.h"
#include "metrale/error.h"

namespace metrale::ops {

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

}  // namespace metrale::ops
