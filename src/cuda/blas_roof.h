// The BF16 tensor-core rate of a CUDA device, the compute roof of `metrale bench` on CUDA:
// cuBLASLt's best BF16 GEMM (FP32 accumulation) measured in the same run. cuBLASLt is loaded
// with dlopen when asked for, never linked, like the driver: a machine without it gets a reason.
#pragma once

#include <string>

#include "metrale/backend.h"

namespace metrale::cuda {

struct Bf16Rate {
  double flops = 0;  // FLOP per second; 0 when it could not be measured
  std::string what;  // how it was measured, or why it was not
};

// Times cuBLASLt's BF16 GEMM of n x n x n (n a multiple of 16) on backend (a CUDA backend),
// with buffers from backend.alloc that are freed before it returns. Never throws: for another
// backend, or a missing or failing cuBLASLt, the reason is in `what` and flops is 0.
Bf16Rate measure_bf16_gemm_rate(Backend& backend, int n = 8192);

}  // namespace metrale::cuda
