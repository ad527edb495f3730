// The float64 reference of the W8A8 GEMM (ops/fp8_gemm.h) on 4-bit weights requantized to
// 128 x 128 block-scaled E4M3 (ops/fp8_requant.h), held to the product with the ORIGINAL 4-bit
// weights, so its bound covers both casts: the numerics suite's and `metrale bench`'s check.
//
// THE BOUND (per element, deterministic). a: the BF16 activations, a8 their cast (one scale sa
// per row per 128 K); w: the 4-bit weights in float64, ŵ their requantized values (one scale sw
// per 128 x 128 block).
//  - Both casts round x / s to E4M3 to nearest: at most half a step, 2^-4 of the value in the
//    normal range and 2^-10 (of s, in x's units) in the subnormal range; a quotient computed in
//    FP32 adds 2^-24 of |x| (2^-23 allowed). So |a8 − a| ≤ Ea = max(2^-4·|a|, 2^-10·sa) +
//    2^-23·|a|, and likewise |ŵ − w| ≤ Ew with sw.
//  - a8·ŵ − a·w = (a8 − a)·ŵ + a·(ŵ − w): the exact Σ a8·ŵ lies within E = Σ (Ea·|ŵ| + |a|·Ew)
//    of ref = Σ a·w (+ bias).
//  - The GEMM on a8 and ŵ: exact E4M3 products and at most K + 2·ceil(K/128) + 1 FP32 roundings
//    (the block sums, two scale products per block, the sum over blocks, the bias), within
//    γ·S8 with γ = (K + 2·ceil(K/128) + 8)·2^-23 (+ a GPU's FP8 tensor-core term) and
//    S8 = Σ |a8·ŵ| + |bias|.
//  - The BF16 output rounding: 2^-8 of a value within |ref| + E + γ·S8.
//  So |out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·(E + γ·S8). A wrong scale, code or bias is off by
//  O(S8), far above E (about 2^-4 of it).
// THE NORM (statistical, as kE4m3VsExactTol): the two casts' relative errors are independent
// and zero-mean, each of RMS at most 2^-4/√3, so the product's is at most √2·2^-4/√3 ≈ 0.051,
// plus the 2^-8 output rounding: kW8a8RequantTol ≈ 0.055, applied from kE4m3StatMinOutputs
// outputs and kE4m3StatMinActs activations (and as many weights).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "metrale/e4m3_block.h"
#include "metrale/quant.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/sampled_check.h"

namespace metrale::toolkit {

inline constexpr double kW8a8RequantTol = 1.4142135623730951 * 0.0360844 + kBf16Unit;  // ≈ 0.055

// One row of A as the W8A8 op casts it (quantize_e4m3_activations): each a8 and its block's scale.
struct CastRow {
  std::vector<double> value, scale;
};
// The cast of a_row (BF16 bit patterns, K of them).
CastRow cast_row(std::span<const std::uint16_t> a_row);

// An output's exact value Σ a·w (+ bias), the bound above for it, and the aware value Σ a8·ŵ
// (+ bias): what the op computes before its FP32 roundings.
struct W8a8Element {
  double value = 0.0;
  double bound = 0.0;
  double aware = 0.0;
};

// Output (row of a_row, column j) of A · Wᵀ for weights wq in block-scaled E4M3, with a8 the
// row's cast. source: the 4-bit weights wq was requantized from, which the reference then
// multiplies (their rounding joins the bound), or null for weights that are E4M3 to begin with
// (an FP8 checkpoint's: the reference multiplies wq itself). mma_term: a GPU's FP8
// accumulation allowance per unit of S8 (0 for the CPU reference, which accumulates in FP32).
// Throws Error(kInvalidArgument) when the shapes disagree.
W8a8Element w8a8_reference_element(const CastRow& a8, std::span<const std::uint16_t> a_row,
                                   const E4m3BlockWeightsView& wq, std::int64_t j, double bias,
                                   double mma_term, const HostQuantWeights* source = nullptr);

// sampled_check for a W8A8 GEMM (no bias): samples outputs of C[M, N], holds each to the bound
// above (around the exact value) and their normalized error against the aware values to
// kNormTol (the FP32 accumulation and the output rounding alone: a statistical bound on the
// casts would need more activations than a small M has, toolkit/gemm_tolerance.h).
SampledCheck sampled_check_w8a8(std::span<const std::uint16_t> a, std::span<const std::uint16_t> c,
                                const E4m3BlockWeightsView& wq, std::int64_t m, double mma_term,
                                std::mt19937_64& rng, const HostQuantWeights* source = nullptr,
                                int samples = 96);

}  // namespace metrale::toolkit
