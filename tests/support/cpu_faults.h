// CpuFaults for a sweep that fails one fallible call of a clean run at a time.
#pragma once

#include <cstdint>

#include "metrale/cpu_backend.h"

namespace metrale::testing {

// Call `at` (1-based) of a run fails; with device_full, allocation `at` instead, with device
// memory too small for any allocation, so weights fall back to managed memory first.
inline CpuFaults failing_call(std::uint64_t at, bool device_full) {
  CpuFaults f;
  f.fail_call_at = at;
  if (device_full) {
    f.fail_call_of = "alloc";
    f.max_device_alloc = 1;
  }
  return f;
}

}  // namespace metrale::testing
