// The CUDA side of discovery and creation (src/core/runtime.cpp calls these when CUDA is built).
#pragma once

#include <memory>

#include "metrale/runtime.h"

namespace metrale::cuda {

// Availability of CUDA device 0, with its properties and the reason when unavailable. Never
// throws for a missing or unusable driver or device.
BackendInfo probe();

// A CUDA backend on device 0: the process host, a freshly loaded module registry, and the
// start-up gate passed. Throws Error(kUnavailable, "CUDA unavailable: ...") when it cannot be.
std::unique_ptr<Backend> create_backend();

}  // namespace metrale::cuda
