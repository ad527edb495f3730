// The CPU twins of module "fp8"'s kernels (src/cuda/kernels/fp8.cu): same arguments, same bytes.
#pragma once

#include <cstdint>

#include "kernels/fp8_cast.h"

namespace metrale::cpu::fp8 {

// The (row, 128-K block) pairs [i0, i1) of p, pair i = m·ceil(K/128) + kb: their codes and
// scales (kernels/fp8_cast.h).
void cast_e4m3_block128(const Fp8CastParams& p, std::int64_t i0, std::int64_t i1);

}  // namespace metrale::cpu::fp8
