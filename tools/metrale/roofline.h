// The roofs a benchmark is measured against, measured on this machine in the same run: memory
// bandwidth (what decode GEMMs can reach) and a compute rate (what prefill GEMMs can reach).
#pragma once

#include <string>

#include "metrale/backend.h"

namespace metrale::cli {

struct Roofline {
  double bandwidth = 0;      // bytes per second
  std::string bandwidth_of;  // what was measured, for the report
  double flops = 0;          // FLOP per second; 0 when not measured
  std::string flops_of;
};

// CPU: a multi-threaded read of a buffer larger than the caches, and FP32 FMAs in registers on
// every thread. CUDA: a device-to-device copy (bytes read + written); the BF16 tensor-core rate
// needs cuBLASLt, which is not wired yet, so flops is 0 there.
Roofline measure_roofline(Backend& backend);

}  // namespace metrale::cli
