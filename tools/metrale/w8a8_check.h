// metrale check's W8A8 rows (ops/fp8_gemm.h): one random problem against the float64 reference
// of the op's own cast.
#pragma once

#include <random>
#include <string>

#include "metrale/model_scope.h"
#include "metrale/quant.h"

namespace metrale::cli {

// Whether scope's backend runs the W8A8 op (it has the kE4m3Block128 dense GEMM).
bool has_w8a8(ModelScope& scope);

// One w8a8_gemm of random shape (ragged N and K) with C poisoned, every element held to
// |out − ref8| ≤ 2^-8·|ref8| + (1 + 2^-8)·(K + 2·ceil(K/128) + 8)·2^-23·S8 against the float64
// product of A cast as the op casts it and the dequantized weights (tests/ops/fp8_gemm_test.cpp
// derives it). Returns the row's detail; throws Error naming the worst element otherwise.
std::string check_w8a8(ModelScope& scope, std::mt19937_64& rng, bool bias);

// One w8a8_gemm on random 4-bit weights of format requantized at upload (ops/fp8_requant.h),
// C poisoned, every element held to toolkit/w8a8_reference.h's bound around the float64
// product with the 4-bit weights and the norm against the cast operands to kNormTol. Returns
// the row's detail; throws Error naming the worst element otherwise.
std::string check_w8a8_requantized(ModelScope& scope, std::mt19937_64& rng, WeightFormat format);

}  // namespace metrale::cli
