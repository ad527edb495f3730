// The float64 reference of the w4a16 GEMM and the comparison of a BF16 result with it, shared by
// the tests, `metrale check`, `metrale bench` and the benchmarks (tolerances in
// toolkit/gemm_tolerance.h).
//
// THE REFERENCE. C_ref[m, n] = Σ_k double(A[m, k]) × double(W[n, k]) (+ double(bias[n])), with
// W[n, k] = HostQuantWeights::exact_weight(n, k) of the host weights that were uploaded (exact in
// double: a weight rounded to float would lose bits in FP32's subnormal range, where a checkpoint's
// all-subnormal BF16 layer lies) and A the BF16 activations, or for the e4m3
// route the E4M3-rounded activations e4m3_to_f32(bf16_to_e4m3(A)) (the e4m3-aware reference).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "metrale/quant.h"
#include "toolkit/gemm_tolerance.h"

namespace metrale::toolkit {

// memset(0xFF) leaves 0xFFFF in every BF16: a NaN, so an unwritten element makes the error NaN.
inline constexpr std::uint8_t kPoisonByte = 0xFF;
inline constexpr std::uint16_t kPoisonBf16 = 0xFFFF;
inline constexpr std::uint32_t kPoisonF32 = 0xFFFFFFFF;  // the same bytes read as FP32: a NaN

struct Reference {
  std::int64_t m = 0, n = 0, k = 0;
  std::vector<double> value;     // C_ref[m, n]
  std::vector<double> abs_sum;   // S = Σ_k |a·w| + |bias|: the scale of the FP32 roundings
  std::vector<double> cast_gap;  // kE4m3 only: Σ_k |A8 − A|·|w| (how far the cast moved it)
  AMode mode = AMode::kBf16;     // kE4m3: the FP8 tensor cores' accumulation term applies
  double weight_rounding = 0.0;  // the weights' relative rounding (GemmTolerance::weight_rounding)
  std::vector<double> act_abs_sum;  // Σ_k |a| per row: the scale of the weights' underflow
};

// One element of the reference: its value and S.
struct ReferenceElement {
  double value = 0.0;
  double abs_sum = 0.0;
  double act_abs_sum = 0.0;  // Σ_k |a| of the row
};

// The activation as the reference sees it.
double activation(std::uint16_t a, AMode mode);

// C_ref from the host weights (any layout: HostQuantWeights::weight reads either); bias may be
// empty.
Reference reference(std::span<const std::uint16_t> a, std::int64_t m, const HostQuantWeights& w,
                    std::span<const std::uint16_t> bias, AMode mode);
// The reference a route's tolerance holds it to: tol's activations and weight rounding.
Reference reference(std::span<const std::uint16_t> a, std::int64_t m, const HostQuantWeights& w,
                    std::span<const std::uint16_t> bias, const GemmTolerance& tol);

// C_ref[row, col] alone (no bias), for a check that samples outputs of a large GEMM; a_row is
// A's row (K values).
ReferenceElement reference_element(std::span<const std::uint16_t> a_row, const HostQuantWeights& w,
                                   std::int64_t col, AMode mode);

// The deterministic per-element bound of an FP32-accumulating kernel with BF16 output, plus the
// FP8 tensor cores' accumulation term for mode kE4m3 and the weights' rounding (derivation in
// gemm_tolerance.h).
double element_bound(double value, double abs_sum, std::int64_t k, AMode mode,
                     double weight_rounding = 0.0, double act_abs_sum = 0.0);
// The absolute part of that bound that underflow adds (gemm_tolerance.h, "Underflow"): 0 for
// nothing, tiny beside any value that is not itself near FP32's smallest normal.
double underflow_bound(std::int64_t k, double weight_rounding, double act_abs_sum) noexcept;
// The same for element i of ref.
double element_bound(const Reference& ref, std::size_t i);

// How an output compares with a reference.
struct Comparison {
  double normalized = std::numeric_limits<double>::quiet_NaN();  // ‖out − ref‖ / ‖ref‖
  double ref_norm = 0.0;
  double worst = 0.0;  // max over elements of |out − ref| / (bound + extra)
  std::int64_t worst_at = -1;
  double worst_out = 0.0, worst_ref = 0.0, worst_bound = 0.0;
  std::int64_t unwritten = 0;  // elements still holding the poison
  std::int64_t nonzero = 0;    // elements that are not ±0
  std::int64_t n = 1;          // columns, for naming the worst element
  std::int64_t count = 0;      // elements compared (M·N)
  double underflow_norm = 0.0;  // ‖underflow_bound‖₂ over the elements: allowed beside the norm

  // Every figure above, in one line.
  std::string str() const;
};

// Compares BF16 out with ref. With add_cast_gap the per-element bound also allows
// (1 + 2^-8) × the cast gap: the e4m3 route against the exact values with the e4m3-aware
// reference's S and gap (|out − exact| ≤ |out − aware| + |aware − exact|, and the 2^-8·|ref|
// term of the aware bound exceeds the exact one's by at most 2^-8 × the gap).
Comparison compare(std::span<const std::uint16_t> out, const Reference& ref,
                   bool add_cast_gap = false);

// Compares FP32 out (GemmOptions::out_f32: no BF16 rounding) with ref: the same figures, each
// element held to element_bound less its BF16 output terms (2^-8·|ref| and BF16's underflow).
Comparison compare_f32(std::span<const float> out, const Reference& ref);

// Whether c meets tol: the reference and the output not all zero, every element written, the
// normalized error within tol (plus the underflow allowance over ‖ref‖) and every element within
// its bound.
bool within(const Comparison& c, double tol);
// The same with a route's tolerance: its normalized bound from tol.norm_min_outputs outputs.
bool within(const Comparison& c, const GemmTolerance& tol);

}  // namespace metrale::toolkit
