#include "metrale/runtime.h"

#include <fmt/format.h>

#include "metrale/cpu_backend.h"
#include "metrale/error.h"

namespace metrale {
namespace {

// Until the CUDA backend is built in, discovery says so plainly instead of probing a driver.
BackendInfo cuda_info() {
  return BackendInfo{
      "cuda", false, "CUDA unavailable: this build of metrale has no CUDA backend", {}};
}

}  // namespace

std::vector<BackendInfo> discover_backends() {
  std::vector<BackendInfo> out;
  out.push_back(cuda_info());
  out.push_back(BackendInfo{"cpu", true, {}, CpuBackend().device_name()});
  return out;
}

std::unique_ptr<Backend> create_backend(std::string_view which) {
  if (which == "cpu") return std::make_unique<CpuBackend>();
  if (which == "cuda") throw Error(ErrorCode::kUnavailable, "create_backend", cuda_info().reason);
  if (which == "auto") return std::make_unique<CpuBackend>();
  throw Error(ErrorCode::kInvalidArgument, "create_backend",
              fmt::format("unknown backend '{}' (expected auto, cpu or cuda)", which));
}

}  // namespace metrale
