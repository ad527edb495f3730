// The buffer checks every op makes before it launches anything (the GEMM, the W8A8 GEMM): a
// pointer present and aligned, an output clear of its inputs, workspace parts on their boundary.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "metrale/backend.h"
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

// A workspace part a plan needs (part: its name, address and the planned bytes; nothing to check
// where those are 0) must be there, aligned, inside one of the backend's own allocations (a
// kernel writes it) and clear of every other buffer of the call.
inline void check_workspace_part(std::string_view api, const Backend& backend, const Range& part,
                                 DevicePtr p, std::initializer_list<Range> others) {
  if (part.bytes == 0) return;
  check_pointer(api, part.name, p);
  backend.check_owned_range(api, part.name, p, part.bytes);
  check_no_overlap(api, part, others);
}

// The byte ranges of one quantized GEMM call's buffers.
struct CallRanges {
  Range a, c, codes, scales, bias;
};

// The checks every GEMM call makes before anything is looked up or launched: A, C and the bias
// present and aligned, C overlapping no input, and every range inside one allocation (the
// kernels read and write them without bounds; a backend that knows its allocations refuses any
// that lies outside one). The byte counts are the caller's, already checked to fit 64 bits.
// Returns the ranges it checked.
inline CallRanges check_call_buffers(std::string_view api, const Backend& backend, DevicePtr a,
                                     std::uint64_t a_bytes, DevicePtr c, std::uint64_t c_bytes,
                                     DevicePtr codes, std::uint64_t codes_bytes, DevicePtr scales,
                                     std::uint64_t scales_bytes, DevicePtr bias,
                                     std::uint64_t bias_bytes) {
  check_pointer(api, "A", a);
  check_pointer(api, "C", c);
  if (bias) check_pointer(api, "bias", bias);
  const CallRanges r{Range{"A", a.address(), a_bytes}, Range{"C", c.address(), c_bytes},
                     Range{"weight codes", codes.address(), codes_bytes},
                     Range{"weight scales", scales.address(), scales_bytes},
                     Range{"bias", bias.address(), bias ? bias_bytes : 0}};
  check_no_overlap(api, r.c, {r.a, r.codes, r.scales, r.bias});
  backend.check_range(api, "A", a, r.a.bytes);
  backend.check_range(api, "weight codes", codes, codes_bytes);
  backend.check_range(api, "weight scales", scales, scales_bytes);
  if (bias) backend.check_range(api, "bias", bias, r.bias.bytes);
  backend.check_range(api, "C", c, r.c.bytes);
  return r;
}

}  // namespace metrale::ops
