// The BF16 tensor-core rate of a CUDA device, the compute roof of `metrale bench` on CUDA:
// cuBLASLt's best BF16 GEMM (FP32 accumulation) measured in the same run, through the backend's
// dense GEMM (Backend::plan_dense_gemm / run_dense_gemm): cuBLASLt is loaded by the CUDA backend
// at run time, never linked, and a machine without it gets the backend's reason.
#pragma once

#include <string>

#include "metrale/backend.h"

namespace metrale::toolkit {

struct Bf16Rate {
  double flops = 0;    // FLOP per second; 0 when it could not be measured
  double seconds = 0;  // per GEMM
  std::string what;    // how it was measured, or why it was not
};

// Times cuBLASLt's BF16 GEMM of n x n x n (n a multiple of 16) on backend (a CUDA backend),
// with buffers from backend.alloc that are freed before it returns. Never throws: for another
// backend, or a missing or failing cuBLASLt, the reason is in `what` and flops is 0.
Bf16Rate measure_bf16_gemm_rate(Backend& backend, int n = 8192);

// Times cuBLASLt's BF16 GEMM of the w4a16 shape C[M, N] = A[M, K] · W[N, K]ᵀ (row-major; M, N
// and K multiples of 16), for a side-by-side comparison on the same shape. Never throws, as above.
Bf16Rate measure_bf16_gemm(Backend& backend, int m, int n, int k);

}  // namespace metrale::toolkit
