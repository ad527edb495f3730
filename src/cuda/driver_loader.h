// Finding the CUDA driver at run time. Loading never crashes and never throws: a machine
// without a usable driver gets a reason that starts with "CUDA unavailable:".
#pragma once

#include <string>

#include "cuda/driver_api.h"

namespace metrale::cuda {

// The driver major version the embedded kernels need (that of the toolkit that built them).
inline constexpr int kRequiredDriverVersion = CUDA_VERSION / 1000 * 1000;

struct DriverLoad {
  const DriverApi* api = nullptr;  // null when the driver is unusable
  std::string reason;              // "CUDA unavailable: ..." when api is null
  int driver_version = 0;          // cuDriverGetVersion, when it could be asked
};

// The reason a driver of this version (cuDriverGetVersion) cannot run the embedded kernels, or
// "" when it can.
std::string driver_too_old(int driver_version);

// Loads libcuda.so.1 once per process (thread-safe) and returns the same result every time.
const DriverLoad& load_driver();

// Loads the named library without caching (tests point it at missing files and stubs). On
// success the library stays loaded for the rest of the process: function pointers into it
// may be held anywhere.
DriverLoad load_driver_from(const char* library);

}  // namespace metrale::cuda
