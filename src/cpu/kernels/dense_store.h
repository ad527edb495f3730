// Writing C from the CPU dense GEMM kernels (module "blas"): one place for the output type.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/dense_params.h"
#include "metrale/numerics.h"

namespace metrale::cpu::blas {

// C element `at` from its final FP32 value (bias added): rounded once to BF16, or stored as it
// is where the shape asks for FP32 C (DenseParams::out_f32).
inline void store_c(const DenseParams& p, std::size_t at, float v) {
  if (p.out_f32 != 0) {
    reinterpret_cast<float*>(p.c)[at] = v;
  } else {
    reinterpret_cast<std::uint16_t*>(p.c)[at] = num::f32_to_bf16(v);
  }
}

}  // namespace metrale::cpu::blas
