// The devices a kernel can say it was verified on (<entry>_verified_on, src/kernels/published.def)
// and the one-line macro a kernel source uses to say it. A device run that passes flips a
// kernel's default by adding its METRALE_VERIFIED line, in the same commit as the run's
// docs/GPU.md record; until then the automatic route and the preferred upload layout do not
// choose it (ops/gemm.cpp, ops/quant_weights.cpp).
//
// Why two u32 fields rather than a string: the published reader (core/published.cpp), the fake
// driver's globals and the offline fatbin test all handle fixed 4-byte values already, a number
// is compared offline without parsing, and a table here keeps the device's name spelled once.
#pragma once

#include <cstdint>

namespace metrale::verified {

// <entry>_verified_on values. 0 (unpublished): no device run has verified the kernel.
inline constexpr std::uint32_t kNone = 0;
// The CPU backend's host modules: they are the reference every GPU result is compared with and
// run in every test run, so they need no device check.
inline constexpr std::uint32_t kHostReference = 1;
inline constexpr std::uint32_t kH200 = 2;  // NVIDIA H200 (sm_90a code)

// The device's name for `metrale info`, or nullptr for an id this build does not know.
constexpr const char* device_name(std::uint32_t id) {
  switch (id) {
    case kH200:
      return "NVIDIA H200";
    default:
      return nullptr;
  }
}

}  // namespace metrale::verified

// In a CUDA kernel source: `entry` was verified on `device` (a name above, without the k) on
// `date` (YYYYMMDD), by the run recorded in docs/GPU.md.
#define METRALE_VERIFIED(entry, device, date)         \
  __device__ std::uint32_t entry##_verified = (date); \
  __device__ std::uint32_t entry##_verified_on = ::metrale::verified::k##device
