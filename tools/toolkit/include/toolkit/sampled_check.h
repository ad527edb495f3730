// The check every benchmark makes before it times a GEMM: a sample of outputs against the float64
// reference, held to the route's entry of the tolerance table (toolkit/gemm_tolerance.h).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>

#include "metrale/ops/gemm.h"
#include "metrale/quant.h"

namespace metrale::toolkit {

struct SampledCheck {
  double normalized = 0;  // ‖got − ref‖ / ‖ref‖ over the samples; infinity for an all-zero ref
  double worst = 0;       // max over the samples of |got − ref| / its per-element bound
  double tolerance = 0;  // the table's bound on normalized
  int samples = 0;
  double underflow = 0;  // the underflow allowance over ‖ref‖ (gemm_tolerance.h, "Underflow")
  // Whether normalized (beside the underflow allowance) and every sample are within their bounds.
  bool passed() const noexcept { return normalized <= tolerance + underflow && worst <= 1.0; }
  // "normalized error …, worst sample … of its bound" for a report.
  std::string str() const;
};

// |d| / bound, the share of its bound an error d uses: infinity for NaN (an unwritten output)
// and for a nonzero error against a zero bound, 0 for no error against one.
double bound_ratio(double d, double bound) noexcept;

// Samples outputs of C[M, N] = A · dequant(W)ᵀ (BF16 A and C, row-major) computed by `route`
// (the one that ran, not kAuto) and compares them with the float64 reference the table names for
// it (the e4m3-aware one for kE4m3). Throws Error(kInvalidArgument) when a or c is smaller than
// the shape or m < 1.
SampledCheck sampled_check(std::span<const std::uint16_t> a, std::span<const std::uint16_t> c,
                           const HostQuantWeights& w, std::int64_t m, ops::GemmRoute route,
                           std::mt19937_64& rng, int samples = 96);

// The same for a dense BF16 GEMM: C[M, N] = A · Wᵀ with W BF16 [N, K] row-major, against the
// float64 product of the BF16 values, held to the exact routes' entry of the table (the BF16
// products are exact, summed in FP32, rounded once to BF16). Throws as sampled_check, and when w
// is smaller than N·K.
SampledCheck sampled_check_dense_bf16(std::span<const std::uint16_t> a,
                                      std::span<const std::uint16_t> c,
                                      std::span<const std::uint16_t> w, std::int64_t n,
                                      std::int64_t k, std::int64_t m, std::mt19937_64& rng,
                                      int samples = 96);

}  // namespace metrale::toolkit
