// The CUDA side of discovery and creation, called by the backend registry (src/registry). It
// knows nothing of the registry's types: it hands back a backend, or why there is none, as data.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cuda/backend.h"
#include "cuda/embedded_modules.h"
#include "cuda/host.h"
#include "metrale/error.h"

namespace metrale::cuda {

// Why CUDA cannot be used here.
struct Unavailable {
  std::string reason;  // "CUDA unavailable: ...", as discovery lists it and auto explains it
  Error error;         // what asking for "cuda" by name throws (its code and message unchanged)
};

// The Unavailable for an Error of the CUDA side. A kUnavailable error's message is its reason
// ("CUDA unavailable: ..."); any other error (a failed driver call, a missing kernel) is named
// whole after "CUDA unavailable: ".
Unavailable unavailable(const Error& error);

// A usable CUDA backend, or why not.
using Opening = std::variant<std::unique_ptr<CudaBackend>, Unavailable>;

// A backend on device 0 of the process host (CudaHost::process) running the embedded modules,
// start-up gate passed; or why not. Every Error becomes an Unavailable, never a throw.
Opening open_backend();

// The same on the host make_host builds, running modules (tests pass a fake driver's).
Opening open_backend(const std::function<std::shared_ptr<CudaHost>()>& make_host,
                     std::span<const EmbeddedModule* const> modules);

// What discovery lists about backend's device: capability, SMs, memory, driver, and each module
// the preflight skipped.
std::vector<std::pair<std::string, std::string>> device_properties(const CudaBackend& backend);

}  // namespace metrale::cuda
