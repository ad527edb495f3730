// The tolerances a w4a16 GEMM result is held to against the float64 reference
// (toolkit/gemm_reference.h), with their derivation, and the one table per route and format that
// the tests, `metrale check`, `metrale bench` and the GPU benchmark read.
//
// THE TOLERANCES (normalized error ‖out − ref‖₂ / ‖ref‖₂ over the whole output, plus a bound
// per element so that one wrong element cannot hide in a norm):
//  - BF16 output rounding: round to nearest even with 8 significant bits (7 stored) moves a
//    value by at most half a unit in the last place, 2^-8 of itself (not 2^-9: 1 + 2^-8 lies
//    halfway between the BF16 neighbours 1 and 1 + 2^-7), so it alone adds ≤ 2^-8 ≈ 3.9e-3 to
//    the normalized error (≈ 1.6e-3 observed on random data).
//  - FP32 accumulation: every product a·w is exact in FP32 (BF16's 8 significant bits × E2M1's 2
//    × E4M3's 4 or E8M0's 1 < 24; likewise E4M3 × E2M1 on the e4m3 route), so the only other
//    roundings are the K − 1 additions (in any order or tree), the group-scale and tensor-scale
//    products and the bias addition: |error| ≤ γ·S with S = Σ_k |a·w| + |bias| and γ = n·u for
//    n ≤ K + 3 roundings. We allow u = 2^-23 (twice FP32's 2^-24, for accumulators that truncate
//    instead of rounding to nearest) and n = K + 8 (slack for the reference's own float weights).
//    Per element: |out − ref| ≤ 2^-8·|ref| + (1 + 2^-8)·(K + 8)·2^-23·S. This bound is
//    deterministic: it holds for every input, so it never flakes, and a correct kernel can't
//    exceed it.
//  - Normalized: S/|ref| grows like √K on zero-mean data (|ref| is a random walk, S a sum of
//    magnitudes): about 0.7·√K here, so for K ≤ 1040 the worst-case accumulation term is
//    1040 · 2^-24 · 23 ≈ 1.4e-3 (2.8e-3 for accumulators that truncate) and the total at most
//    3.9e-3 + 2.8e-3 ≈ 6.7e-3 < kNormTol = 8e-3, while any real defect (a wrong scale, a
//    swapped nibble, a missing bias, a skipped k, an unwritten element, which reads as NaN) is
//    far above it. A single wrong element of a large output can hide in the norm, so the per-
//    element bound is always checked as well.
//  - The e4m3 route against the exact-BF16 reference: casting A to E4M3 (3 mantissa bits) moves
//    each activation by at most 2^-4 of itself (2^-10 absolute in E4M3's subnormal range). With
//    independent zero-mean rounding errors the normalized error of the products is the RMS
//    relative cast error, at most 2^-4/√3 ≈ 0.036 (relative errors spread over ±2^-4 at most; in
//    fact ≈ 0.025, because only the bottom of each binade reaches 2^-4), plus the 2^-8 output
//    rounding: kE4m3VsExactTol ≈ 0.040. That is a statistical estimate: it needs many outputs
//    (with few, cancellation can make ‖ref‖ tiny) and many activations (all outputs of a row
//    share its rounding errors, and with magnitudes spread over 13 octaves a few large ones
//    dominate). So it is applied only from kE4m3StatMinOutputs outputs and kE4m3StatMinActs
//    activations: simulating this suite's data there gave mean 0.025 and at most 0.032 in 2,000
//    draws per shape (with M·K = 1024 the maximum reached 0.037; with one output, 97). The route
//    is ALSO held, element by element, to the deterministic bound above against the e4m3-aware
//    reference (the tight check), and to that bound plus Σ_k |A8 − A|·|w| (exact, by the
//    triangle inequality) against the exact-BF16 one, on every shape.
//  - The e4m3 route's tensor cores: Hopper's FP8 MMA does not accumulate in full FP32. Its
//    products are exact, but they are aligned to the largest of them and summed with about 13
//    fraction bits (an e8m13 accumulator, truncating: DeepSeek-V3's report, §3.3.2, measured
//    "around 14 bits" on H800; the PyTorch FP8 notes give 13), and the sum is truncated to that
//    width again. The route issues one MMA per 16-K group into a fresh accumulator (the group
//    scale is applied in FP32 after it), so per group each of the 16 aligned products loses
//    less than 2^-13 of the largest and the sum less than 2^-13 of itself: at most
//    (16 + 1)·2^-13·S_g, with S_g = Σ over the group of |a8·w|. Summed over the groups, the
//    e4m3-aware bound adds kFp8MmaTerm·S = 17·2^-13·S ≈ 2.1e-3·S. Measured on an H200
//    (2026-11-29, docs/GPU.md): the worst element of the suite reached 1.1·2^-13·S, and the
//    normalized error stayed at 1.6e-3 (the output rounding), so the norm check is unchanged;
//    a wrong scale, nibble or bias is still off by O(S), hundreds of times this term. The CPU
//    backend's route accumulates in FP32 and is held to the same bound.
//  - Beyond K = 1040 (the benchmarks' layers reach K = 28,672) the worst-case accumulation term
//    of the norm grows like K^1.5, but only if every rounding of every element goes the same
//    way; the per-element bound still holds deterministically, and on random data the rounding
//    errors do not align, so the norm stays at the output rounding: `metrale bench --backend
//    cpu --shapes 64x14336,256x28672 --m 1,20` read 1.4e-3 to 2.1e-3 on every route (and 1.7e-3
//    on the e4m3 route at K = 14,336). The norm bound is kept.
//  - The dequant route (kernels/dequant_bf16.h): W is dequantized to BF16 with the tensor scale
//    folded in, then a dense GEMM multiplies exact BF16 products and sums them in FP32. With a
//    tensor scale that is a power of two (MXFP4's is 1) every BF16 weight is exact and the route
//    meets the bounds above unchanged (the tests hold it to them). Any other tensor scale rounds
//    each weight once: ŵ = w·(1 + δ), |δ| ≤ 2^-8 (half a BF16 unit). Per element that adds
//    |Σ a·w·δ| ≤ 2^-8·S, and the accumulation's γ applies to Σ|a·ŵ| ≤ (1 + 2^-8)·S, so the bound
//    becomes 2^-8·|ref| + (1 + 2^-8)·(γ + u_w + γ·u_w)·S with u_w = kDequantWeightUnit = 2^-8:
//    deterministic, never flaky, and a wrong scale, nibble or bias is still off by O(S). In the
//    norm the δ are independent: ‖Σ a·w·δ‖ / ‖ref‖ is their RMS weighted by (a·w)², at most
//    max|δ| = 2^-8 (≈ 1.3e-3 observed), so kDequantNormTol = kNormTol + 2^-8 ≈ 1.2e-2. That
//    holds once there are enough outputs that ‖ref‖² ≈ Σ (a·w)² (with one output, cancellation
//    can make ‖ref‖ arbitrarily small against the δ's, which do not cancel with it): the norm is
//    applied from kDequantStatMinOutputs = 256 outputs (M·N), the per-element bound always. The
//    other routes' entries are unchanged.
//  - The dequant route's bias: its dense GEMM is cuBLASLt's BF16 one with the bias in the
//    epilogue. On the H200 (cuBLASLt 13.1, run 6, 2026-12-04, docs/GPU.md) that rounds once,
//    RNE(P + bias), where N is a multiple of 8, but where it is not (N = 63, 255, 257 seen) it
//    rounds the product to BF16 before adding the bias: RNE(RNE(P) + bias), one more rounding
//    of at most 2^-8·|P| ≤ 2^-8·S (tests/gpu/dense_gemm_test.cpp, Bf16BiasRoundsOnceOrTwice,
//    tells the two apart element by element, per shape). Run 6 saw the bound above exceeded by
//    up to 1.05× there at K = 16, where the bias is a large part of S. So the entry's u_w is
//    kDequantWeightUnit + kBf16Unit = 2^-7, the weights' rounding and the product's, for every
//    shape (the table does not know N; Note [cuBLASLt bias rounding] in docs/NOTES.md). A wrong
//    scale, nibble or bias is still off by O(S).
//  - INT4 (Note [INT4 weights]): W = (code − zero)·s with a BF16 or FP16 scale s is exact in FP32
//    (a 5-bit integer times an 11-bit significand), and so is each product with a BF16 a (8 more
//    bits), so the derivation above holds with one change. The vector kernels do not form
//    code − zero: they sum a·(code − 8) and, for asymmetric weights, a·(8 − zero) apart (one
//    lookup table for every zero point) and add the two per group, so their roundings scale with
//    Σ_k |a|·(|code − 8| + |8 − zero|)·s rather than Σ_k |a·w|, which is smaller where code ≈ zero
//    far from 8. The reference takes that sum as S for INT4 (gemm_reference.cpp,
//    magnitude_rows); for symmetric weights (zero 8) it is Σ|a·w| itself. A wrong scale, zero
//    point or nibble is still off by O(|a|·s) per product, far above it. The normalized bound is
//    unchanged: on random data it is the BF16 output rounding as for the FP4 formats. On the
//    dequant route (dequant_int4_bf16, kernels/dequant_int4.h) each weight is rounded once to
//    BF16, |δ| ≤ 2^-9 < kDequantWeightUnit, so the route's entry covers INT4 as it stands.
//  - Underflow: every relative figure above holds in the normal range only. A rounding whose
//    result lies in a format's subnormal range errs by up to half its smallest subnormal, an
//    absolute amount: 2^-134 for the BF16 output (its smallest subnormal is 2^-133), 2^-150 for
//    each FP32 product, sum or scale product (2^-149 allowed, for truncation), and for the
//    dequant route 2^-134 per subnormal BF16 weight, times |a|. So the per-element bound adds
//    (1 + 2^-8)·(2^-134 + (K + 8)·2^-149 [+ 2^-134·Σ_k |a|]) and the normalized check allows the
//    2-norm of those terms over ‖ref‖. Both are below 10^-38 (K < 10^6), so on data that is not
//    itself near FP32's smallest normal (1.2e-38) they change nothing; on a checkpoint layer whose
//    BF16 weights are all subnormal (|w| ≤ 1.2e-38) the outputs are that small too, and BF16
//    output underflow alone reached 114 times the old bound (a correct result, reported WRONG).
//    A wrong scale, nibble or bias is still off by O(S), far above them.
#pragma once

#include <cmath>
#include <cstdint>

#include "metrale/ops/gemm.h"
#include "metrale/quant.h"

namespace metrale::toolkit {

inline constexpr double kBf16Unit = 1.0 / 256.0;                  // 2^-8
inline constexpr double kAccumUnit = 1.0 / 8388608.0;             // 2^-23
inline constexpr double kFp8MmaTerm = 17.0 / 8192.0;              // (16 + 1)·2^-13, e4m3 route
inline constexpr double kNormTol = 8e-3;                          // decode, tiled, e4m3 (aware)
inline constexpr double kE4m3VsExactTol = 0.0360844 + kBf16Unit;  // 2^-4/√3 + 2^-8 ≈ 0.040
inline constexpr std::int64_t kE4m3StatMinOutputs = 256;          // M·N
inline constexpr std::int64_t kE4m3StatMinActs = 4096;            // M·K
inline constexpr double kDequantWeightUnit = kBf16Unit;           // a BF16 weight's rounding
inline constexpr double kDequantNormTol = kNormTol + kBf16Unit;   // ≈ 1.2e-2, dequant route
inline constexpr std::int64_t kDequantStatMinOutputs = 256;       // M·N
inline constexpr double kBf16Underflow = 0x1p-134;                // half BF16's least subnormal
inline constexpr double kAccumUnderflow = 0x1p-149;               // FP32's least subnormal

// Which activations the float64 reference multiplies: the BF16 values, or the E4M3-rounded ones
// the e4m3 route computes with (the e4m3-aware reference).
enum class AMode { kBf16, kE4m3 };

// What a route's result is held to: the reference it is compared with (whose mode also adds the
// FP8 tensor cores' term to the per-element bound) and the bound on the normalized error.
struct GemmTolerance {
  AMode reference = AMode::kBf16;
  double normalized = kNormTol;
  // The relative rounding of each weight before the GEMM and of the product before the bias
  // (the dequant route's BF16 W and cuBLASLt's epilogue; 0: exact weights, one rounding): the
  // per-element bound adds (1 + 2^-8)·(γ + u_w + γ·u_w)·S.
  double weight_rounding = 0.0;
  // The normalized bound applies from this many outputs (M·N); the per-element bound always.
  std::int64_t norm_min_outputs = 0;
};

// The table: decode and tiled against the exact-BF16 reference, e4m3 against the e4m3-aware one,
// each with kNormTol and the per-element bound; dequant against the exact-BF16 reference with its
// weights' rounding (for any tensor scale: the table does not know it). The formats share their
// entries: every product is exact in FP32 for both (E4M3 and E8M0 scales alike), so the
// derivation does not depend on the format. (The e4m3 route is also held to kE4m3VsExactTol
// against the exact reference, a statistical bound the tests apply on large enough shapes.)
constexpr GemmTolerance gemm_tolerance(ops::GemmRoute route, WeightFormat format) noexcept {
  if (route == ops::GemmRoute::kDequant) {
    return GemmTolerance{AMode::kBf16, kDequantNormTol, kDequantWeightUnit + kBf16Unit,
                         kDequantStatMinOutputs};
  }
  // The grouped fused route on INT4 experts (gemm_grouped_int4_fused) rounds each weight to BF16
  // once, as the dequant route's W, and sums in FP32 with no rounding of the product before the
  // bias (its epilogue is FP32): the weights' rounding alone.
  if (route == ops::GemmRoute::kFused && format == WeightFormat::kInt4) {
    return GemmTolerance{AMode::kBf16, kDequantNormTol, kDequantWeightUnit, kDequantStatMinOutputs};
  }
  return route == ops::GemmRoute::kE4m3 ? GemmTolerance{AMode::kE4m3, kNormTol}
                                        : GemmTolerance{AMode::kBf16, kNormTol};
}

// Row-parallel layers (docs/RELIABILITY.md, "Collectives across ranks"): the ranks' result and
// one rank's are FP32 sums of the same products in two orders, each with at most `roundings`
// FP32 roundings of 2^-24 of S = Σ|a·w| + |bias| (the W4A16 layer: 2K + ranks + 4, counting the
// one-rank sum's K and the ranks' K plus their sum; the W8A8 layer: 2·(ceil(K/128) + ranks + 4),
// its products summed exactly per block first), then one BF16 rounding each. The returned ratio
// of |c_tp − c_one| to that bound passes at ≤ 1.
inline double row_parallel_ratio(double c_tp, double c_one, double magnitude,
                                 double roundings) noexcept {
  const double bound = std::ldexp(std::fabs(c_tp) + std::fabs(c_one), -8) +
                       roundings * std::ldexp(magnitude, -24) + 1e-30;
  return std::fabs(c_tp - c_one) / bound;
}

// The ranks' result against the float64 product: half those FP32 roundings (its own sums) and
// its one BF16 rounding. Passes at ≤ 1.
inline double row_parallel_exact_ratio(double c_tp, double exact, double magnitude,
                                       double roundings) noexcept {
  const double bound =
      std::ldexp(std::fabs(exact), -8) + roundings / 2 * std::ldexp(magnitude, -24) + 1e-30;
  return std::fabs(c_tp - exact) / bound;
}

}  // namespace metrale::toolkit
