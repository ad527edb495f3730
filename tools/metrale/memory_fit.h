// Whether a command's buffers can fit, checked before anything is allocated: an impossible size
// is refused with the bytes needed and the bytes available instead of ending in std::bad_alloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace metrale {
class Backend;
}

namespace metrale::cli {

// a × b, or SIZE_MAX when that overflows (sizes that large are refused anyway).
std::size_t saturating_mul(std::size_t a, std::size_t b) noexcept;
// a + b, or SIZE_MAX when that overflows.
std::size_t saturating_add(std::size_t a, std::size_t b) noexcept;

// Host memory a new allocation can use now (MemAvailable), or SIZE_MAX when unknown.
std::size_t host_available_bytes();

// One NVFP4 GEMM layer to fit: N × K weights, made on the host first when host_copy.
struct GemmLayerSize {
  std::string name;
  std::int64_t n = 0, k = 0;
  bool host_copy = false;  // random weights, generated on the host before the upload
};

// require_fit for GEMM layers run at up to max_m rows: one copy of each layer's NVFP4 weights
// (codes K/2 and scales K/16 bytes per row) on the device and, with host_copy, on the host, plus
// the largest A (also on the host) and C in BF16.
void require_gemm_fit(const Backend& backend, std::string_view api,
                      const std::vector<GemmLayerSize>& layers, std::int64_t max_m);

// Throws Error(kInvalidArgument, api) naming what, the bytes needed and the bytes available when
// host_bytes of host memory plus device_bytes of backend's memory cannot fit (on the CPU backend
// both are host memory, so they are added).
void require_fit(const Backend& backend, std::string_view api, std::string_view what,
                 std::size_t host_bytes, std::size_t device_bytes);

}  // namespace metrale::cli
