// Backend discovery and creation: which devices this process can use, and the best one.
// Discovery never throws for a missing GPU: an unusable backend is reported with its reason.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/backend.h"

namespace metrale {

// What discovery found for one backend kind.
struct BackendInfo {
  std::string name;        // "cpu", "cuda"
  bool available = false;  // whether create_backend(name) will succeed
  std::string reason;      // why not, when unavailable ("CUDA unavailable: ...")
  std::string device;      // device name, when available
};

// Every backend kind with its availability, the preferred one first.
std::vector<BackendInfo> discover_backends();

// A new backend: "cpu", "cuda", or "auto" (CUDA when available, else CPU). Throws
// Error(kUnavailable) naming the reason when the asked-for backend cannot be used, and
// Error(kInvalidArgument) for an unknown name.
std::unique_ptr<Backend> create_backend(std::string_view which = "auto");

}  // namespace metrale
