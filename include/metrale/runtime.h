// Backend discovery and creation: which devices this process can use, and the best one.
// Discovery never throws for a missing GPU: an unusable backend is reported with its reason.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "metrale/backend.h"

namespace metrale {

// A kernel with the metadata its lookup published.
struct KernelListing {
  std::string name;
  std::uint32_t n_tile = 0;  // 0: publishes none
  bool a_e4m3 = false;
  // "verified on <GPU>, <YYYY-MM-DD>", "not yet run on a GPU", "the host reference" or "not on
  // this target", from what the kernel publishes (src/kernels/verified_devices.h).
  std::string verified;
};

// A module with its kernels' metadata.
struct ModuleDescription {
  std::string name;
  std::string target;
  std::vector<KernelListing> kernels;
};

// What discovery found for one backend kind.
struct BackendInfo {
  std::string name;        // "cpu", "cuda"
  bool available = false;  // whether create_backend(name) will succeed
  std::string reason;      // why not, when unavailable ("CUDA unavailable: ...")
  std::string device;      // device name, when available
  std::vector<std::pair<std::string, std::string>> properties;  // "memory", "SMs", "driver", ...
  std::vector<ModuleDescription> modules;                       // loaded modules, when available
};

// Every backend kind with its availability, the preferred one first. Available backends are
// created briefly to list their modules and kernel metadata.
std::vector<BackendInfo> discover_backends();

// Resolves every kernel of every loaded module of backend and reports its published metadata.
std::vector<ModuleDescription> describe_modules(Backend& backend);

// A new backend: "cpu", "cuda", or "auto" (CUDA when available, else CPU). Throws
// Error(kUnavailable) naming the reason when the asked-for backend cannot be used, and
// Error(kInvalidArgument) for an unknown name. With auto, *why (when given) says which backend
// was chosen and, for CPU, why CUDA was not.
std::unique_ptr<Backend> create_backend(std::string_view which = "auto",
                                        std::string* why = nullptr);

}  // namespace metrale
