// The buffer checks every op makes before it launches anything (the GEMM, the W8A8 GEMM): a
// pointer present and aligned, an output clear of its inputs, workspace parts on their boundary.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "metrale/error.h"
#include "metrale/handles.h"

namespace metrale::ops {

inline constexpr std::uint64_t kAlign = 16;            // vector loads on every backend
inline constexpr std::uint64_t kWorkspaceAlign = 256;  // each workspace part starts on one

// One buffer of a call, for messages and overlap checks.
struct Range {
  const char* name;
  std::uint64_t begin, bytes;
};

// v rounded up to the workspace boundary.
inline std::uint64_t align_up(std::uint64_t v) {
  return (v + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Throws Error(kInvalidArgument) naming api and the buffer when p is null or not kAlign-aligned.
inline void check_pointer(std::string_view api, const char* name, DevicePtr p) {
  if (!p) throw Error(ErrorCode::kInvalidArgument, api, fmt::format("{} is null", name));
  if (p.address() % kAlign != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} = 0x{:x} is not {}-byte aligned", name, p.address(), kAlign));
  }
}

// Throws Error(kInvalidArgument) naming both buffers when out overlaps any of others (empty
// ranges overlap nothing).
inline void check_no_overlap(std::string_view api, const Range& out,
                             std::initializer_list<Range> others) {
  for (const Range& in : others) {
    if (in.bytes == 0 || out.bytes == 0) continue;
    if (out.begin < in.begin + in.bytes && in.begin < out.begin + out.bytes) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("{} [0x{:x}, +{}) overlaps {} [0x{:x}, +{})", out.name, out.begin,
                              out.bytes, in.name, in.begin, in.bytes));
    }
  }
}

}  // namespace metrale::ops
