// The CPU twins of module "fp8"'s kernels (src/cuda/kernels/fp8.cu): same arguments, same bytes.
#pragma once

#include <cstdint>

#include "kernels/fp8_cast.h"

namespace metrale::cpu::fp8 {

// The (row, 128-K block) pairs [i0, i1) of p, pair i = m·ceil(K/128) + kb: their codes and
// scales (kernels/fp8_cast.h), by cast_e4m3_block128_avx512 where the processor has AVX-512.
void cast_e4m3_block128(const Fp8CastParams& p, std::int64_t i0, std::int64_t i1);

// cast_e4m3_block128 element by element, in portable code: the rules as written.
void cast_e4m3_block128_scalar(const Fp8CastParams& p, std::int64_t i0, std::int64_t i1);

// cast_e4m3_block128 sixteen elements a step with AVX-512 (F, BW, VL, DQ): the same bytes; a block
// holding a NaN takes the scalar kernel (its scale is that NaN's magnitude / 448, bit for bit).
void cast_e4m3_block128_avx512(const Fp8CastParams& p, std::int64_t i0, std::int64_t i1);

// out[i] = the E4M3 code of x[i] / s (fp8::encode), sixteen at a time with AVX-512, for i < n:
// the vector kernel's encoder, exposed for its exhaustive test.
void encode_e4m3_avx512(const float* x, float s, std::uint8_t* out, std::int64_t n);

}  // namespace metrale::cpu::fp8
