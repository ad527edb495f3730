#include "toolkit/w8a8_reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale::toolkit {
namespace {

// Half an E4M3 step of x / s in x's units, plus an FP32 quotient's rounding.
double cast_error(double x, double s) {
  return std::max(std::ldexp(std::fabs(x), -4), std::ldexp(s, -10)) + std::ldexp(std::fabs(x), -23);
}

}  // namespace

CastRow cast_row(std::span<const std::uint16_t> a_row) {
  const auto k = static_cast<std::int64_t>(a_row.size());
  const HostE4m3Activations q = quantize_e4m3_activations(a_row, 1, k);
  CastRow r;
  r.value.resize(a_row.size());
  r.scale.resize(a_row.size());
  for (std::int64_t i = 0; i < k; ++i) {
    // One row: the scales [ceil(K/128), 1] are one per block.
    const double s = q.scales[static_cast<std::size_t>(i / kE4m3Block)];
    r.scale[static_cast<std::size_t>(i)] = s;
    r.value[static_cast<std::size_t>(i)] =
        num::e4m3_to_f32(q.codes[static_cast<std::size_t>(i)]) * s;
  }
  return r;
}

W8a8Element w8a8_reference_element(const CastRow& a8, std::span<const std::uint16_t> a_row,
                                   const E4m3BlockWeightsView& wq, std::int64_t j, double bias,
                                   double mma_term, const HostQuantWeights* source) {
  if ((source != nullptr && (source->n != wq.n || source->k != wq.k)) ||
      std::ssize(a_row) != wq.k || std::ssize(a8.value) != wq.k || j < 0 || j >= wq.n) {
    throw Error(
        ErrorCode::kInvalidArgument, "w8a8_reference_element",
        fmt::format(
            "weights {}x{}{}, a row of {} ({} cast), column {}", wq.n, wq.k,
            source != nullptr ? fmt::format(" requantized from {}x{}", source->n, source->k) : "",
            a_row.size(), a8.value.size(), j));
  }
  double ref = bias, aware = bias, s8 = std::fabs(bias), e = 0.0;
  for (std::int64_t q = 0; q < wq.k; ++q) {
    const auto at = static_cast<std::size_t>(q);
    const double x = num::bf16_to_f32(a_row[at]), wh = wq.weight(j, q);
    // The weight the result is held to: the 4-bit one, which its requantization moved by at
    // most cast_error of its block's scale; or the E4M3 weight itself, exactly.
    const double wx = source != nullptr ? source->exact_weight(j, q) : wh;
    ref += x * wx;
    aware += a8.value[at] * wh;
    s8 += std::fabs(a8.value[at] * wh);
    e += cast_error(x, a8.scale[at]) * std::fabs(wh);
    if (source != nullptr) e += std::fabs(x) * cast_error(wx, wq.scale(j, q));
  }
  const double gamma =
      static_cast<double>(wq.k + 2 * e4m3_blocks(wq.k) + 8) * kAccumUnit + mma_term;
  return {ref, kBf16Unit * std::fabs(ref) + (1.0 + kBf16Unit) * (e + gamma * s8), aware};
}

SampledCheck sampled_check_w8a8(std::span<const std::uint16_t> a, std::span<const std::uint16_t> c,
                                const E4m3BlockWeightsView& wq, std::int64_t m, double mma_term,
                                std::mt19937_64& rng, const HostQuantWeights* source, int samples) {
  const E4m3BlockWeightsView& w = wq;
  if (m < 1 || samples < 1 || a.size() < static_cast<std::size_t>(m * w.k) ||
      c.size() < static_cast<std::size_t>(m * w.n)) {
    throw Error(ErrorCode::kInvalidArgument, "sampled_check_w8a8",
                fmt::format("M = {}, {} samples, {} activations and {} outputs for N = {}, K = {}",
                            m, samples, a.size(), c.size(), w.n, w.k));
  }
  std::uniform_int_distribution<std::int64_t> pick_m(0, m - 1), pick_n(0, w.n - 1);
  SampledCheck r;
  r.tolerance = kNormTol;
  r.samples = samples;
  double num = 0, den = 0;
  for (int s = 0; s < samples; ++s) {
    const std::int64_t i = pick_m(rng), j = pick_n(rng);
    const auto row = a.subspan(static_cast<std::size_t>(i * w.k), static_cast<std::size_t>(w.k));
    const W8a8Element ref =
        w8a8_reference_element(cast_row(row), row, wq, j, 0.0, mma_term, source);
    const double got = num::bf16_to_f32(c[static_cast<std::size_t>(i * w.n + j)]);
    num += (got - ref.aware) * (got - ref.aware);
    den += ref.aware * ref.aware;
    const double d = got - ref.value;
    r.worst = std::max(r.worst, bound_ratio(d, ref.bound));
  }
  r.normalized = den > 0 ? std::sqrt(num / den) : INFINITY;
  return r;
}

}  // namespace metrale::toolkit
