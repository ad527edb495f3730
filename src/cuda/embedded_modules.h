// The kernel modules compiled into this build (cmake/cuda_modules.cmake generates the list).
#pragma once

#include <span>
#include <string_view>
#include <vector>

namespace metrale::cuda {

struct EmbeddedModule {
  std::string_view name;                  // "core", "w4a16"
  std::span<const unsigned char> image;   // fatbin, cubin or PTX text
  std::vector<std::string_view> targets;  // "sm_90a", "compute_80", ...
  std::vector<std::string_view> entries;  // kernels the module must provide
};

// Every module of this build, in build order.
std::span<const EmbeddedModule* const> embedded_modules();

}  // namespace metrale::cuda
