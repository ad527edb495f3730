#include "toolkit/sampled_check.h"

#include <fmt/format.h>

#include <cmath>

#include "metrale/error.h"
#include "metrale/numerics.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/gemm_tolerance.h"

namespace metrale::toolkit {

std::string SampledCheck::str() const {
  return fmt::format(
      "normalized error {:.1e} (tolerance {:.1g}), worst of {} samples at {:.2f} of its bound",
      normalized, tolerance, samples, worst);
}

double bound_ratio(double d, double bound) noexcept {
  return std::isnan(d) ? INFINITY : bound > 0.0 ? std::fabs(d) / bound : d == 0.0 ? 0.0 : INFINITY;
}

SampledCheck sampled_check(std::span<const std::uint16_t> a, std::span<const std::uint16_t> c,
                           const HostQuantWeights& w, std::int64_t m, ops::GemmRoute route,
                           std::mt19937_64& rng, int samples) {
  // A's columns (a padded act-order K slice stores more; w.k counts the terms summed).
  const std::int64_t cols = a_columns(w);
  if (m < 1 || samples < 1 || a.size() < static_cast<std::size_t>(m * cols) ||
      c.size() < static_cast<std::size_t>(m * w.n)) {
    throw Error(ErrorCode::kInvalidArgument, "sampled_check",
                fmt::format("M = {}, {} samples, {} activations and {} outputs for N = {}, K = {}",
                            m, samples, a.size(), c.size(), w.n, cols));
  }
  const GemmTolerance tol = gemm_tolerance(route, w.format);
  std::uniform_int_distribution<std::int64_t> pick_m(0, m - 1), pick_n(0, w.n - 1);
  SampledCheck r;
  r.tolerance = tol.normalized;
  r.samples = samples;
  double num = 0, den = 0, under = 0;
  for (int s = 0; s < samples; ++s) {
    const std::int64_t i = pick_m(rng), j = pick_n(rng);
    const ReferenceElement ref = reference_element(
        a.subspan(static_cast<std::size_t>(i * cols), static_cast<std::size_t>(cols)), w, j,
        tol.reference);
    const double got = num::bf16_to_f32(c[static_cast<std::size_t>(i * w.n + j)]);
    const double d = got - ref.value;
    num += d * d;
    den += ref.value * ref.value;
    const double bound = element_bound(ref.value, ref.abs_sum, w.k, tol.reference,
                                       tol.weight_rounding, ref.act_abs_sum);
    const double u = underflow_bound(w.k, tol.weight_rounding, ref.act_abs_sum);
    under += u * u;
    r.worst = std::max(r.worst, bound_ratio(d, bound));
  }
  r.normalized = den > 0 ? std::sqrt(num / den) : INFINITY;
  r.underflow = den > 0 ? std::sqrt(under / den) : 0.0;
  return r;
}

SampledCheck sampled_check_dense_bf16(std::span<const std::uint16_t> a,
                                      std::span<const std::uint16_t> c,
                                      std::span<const std::uint16_t> w, std::int64_t n,
                                      std::int64_t k, std::int64_t m, std::mt19937_64& rng,
                                      int samples) {
  if (m < 1 || n < 1 || k < 1 || samples < 1 || a.size() < static_cast<std::size_t>(m * k) ||
      c.size() < static_cast<std::size_t>(m * n) || w.size() < static_cast<std::size_t>(n * k)) {
    throw Error(ErrorCode::kInvalidArgument, "sampled_check_dense_bf16",
                fmt::format("M = {}, {} samples, {} activations, {} weights and {} outputs for "
                            "N = {}, K = {}",
                            m, samples, a.size(), w.size(), c.size(), n, k));
  }
  const GemmTolerance tol = gemm_tolerance(ops::GemmRoute::kTiled, WeightFormat::kNvfp4);
  std::uniform_int_distribution<std::int64_t> pick_m(0, m - 1), pick_n(0, n - 1);
  SampledCheck r;
  r.tolerance = tol.normalized;
  r.samples = samples;
  double num = 0, den = 0, under = 0;
  for (int s = 0; s < samples; ++s) {
    const std::int64_t i = pick_m(rng), j = pick_n(rng);
    double value = 0, abs_sum = 0, act_abs_sum = 0;
    for (std::int64_t x = 0; x < k; ++x) {
      const double av = num::bf16_to_f32(a[static_cast<std::size_t>(i * k + x)]);
      const double p = av * num::bf16_to_f32(w[static_cast<std::size_t>(j * k + x)]);
      value += p;
      abs_sum += std::fabs(p);
      act_abs_sum += std::fabs(av);
    }
    const double got = num::bf16_to_f32(c[static_cast<std::size_t>(i * n + j)]);
    const double d = got - value;
    num += d * d;
    den += value * value;
    const double bound = element_bound(value, abs_sum, k, tol.reference, 0.0, act_abs_sum);
    const double u = underflow_bound(k, 0.0, act_abs_sum);
    under += u * u;
    r.worst = std::max(r.worst, bound_ratio(d, bound));
  }
  r.normalized = den > 0 ? std::sqrt(num / den) : INFINITY;
  r.underflow = den > 0 ? std::sqrt(under / den) : 0.0;
  return r;
}

}  // namespace metrale::toolkit
