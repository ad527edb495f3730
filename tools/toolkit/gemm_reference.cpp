#include "toolkit/gemm_reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/quant_int4.h"
#include "metrale/numerics.h"

namespace metrale::toolkit {

namespace {

// Rows [row0, row0 + rows) of what each product's roundings scale with, row-major: |W| for the
// FP4 formats; for INT4, (|code − 8| + |8 − zero|)·scale, since its vector kernels sum
// a·(code − 8) and a·(8 − zero) apart (gemm_tolerance.h, "INT4").
void magnitude_rows(const HostQuantWeights& w, std::int64_t row0, std::int64_t rows,
                    std::span<const double> exact, std::span<double> out) {
  if (w.format != WeightFormat::kInt4) {
    std::transform(exact.begin(), exact.end(), out.begin(), [](double x) { return std::fabs(x); });
    return;
  }
  const std::vector<std::int64_t> stored = int4::stored_columns(w);
  const std::int64_t cols = a_columns(w);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::int64_t j = stored[static_cast<std::size_t>(c)];
      const int zero = int4::stored_zero(w, row0 + r, j);
      out[static_cast<std::size_t>(r * cols + c)] =
          (std::abs(int4::stored_code(w, row0 + r, j) - 8) + std::abs(8 - zero)) *
          std::fabs(static_cast<double>(int4::stored_scale(w, row0 + r, j)));
    }
  }
}

}  // namespace

double activation(std::uint16_t a, AMode mode) {
  return mode == AMode::kBf16 ? double{num::bf16_to_f32(a)}
                              : double{num::e4m3_to_f32(num::bf16_to_e4m3(a))};
}

Reference reference(std::span<const std::uint16_t> a, std::int64_t m, const HostQuantWeights& w,
                    std::span<const std::uint16_t> bias, AMode mode) {
  // k: A's columns (a padded act-order K slice stores more: metrale/quant.h, k_perm).
  const std::int64_t n = w.n, k = a_columns(w);
  // The weights and activations as doubles once: weight() decodes a scale per call.
  std::vector<double> wd(static_cast<std::size_t>(n * k)), md(wd.size());
  w.exact_rows(0, n, wd);
  magnitude_rows(w, 0, n, wd, md);
  std::vector<double> ad(static_cast<std::size_t>(m * k)), gap(static_cast<std::size_t>(m * k));
  for (std::size_t i = 0; i < ad.size(); ++i) {
    ad[i] = activation(a[i], mode);
    gap[i] = std::fabs(ad[i] - double{num::bf16_to_f32(a[i])});
  }
  Reference ref;
  ref.mode = mode;
  ref.m = m;
  ref.n = n;
  ref.k = w.k;  // the terms the kernels sum, a padded slice's zeros included
  ref.value.resize(static_cast<std::size_t>(m * n));
  ref.abs_sum.resize(ref.value.size());
  ref.cast_gap.assign(ref.value.size(), 0.0);
  ref.act_abs_sum.assign(static_cast<std::size_t>(m), 0.0);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t c = 0; c < k; ++c)
      ref.act_abs_sum[static_cast<std::size_t>(i)] +=
          std::fabs(ad[static_cast<std::size_t>(i * k + c)]);
  }
  const double* W = wd.data();
  const double* M = md.data();
  const double* A = ad.data();
  const double* G = gap.data();
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      const double* ar = A + i * k;
      const double* wr = W + j * k;
      const double* mr = M + j * k;
      double sum = 0.0, abs = 0.0, g = 0.0;
      for (std::int64_t c = 0; c < k; ++c) {
        sum += ar[c] * wr[c];
        abs += std::fabs(ar[c]) * mr[c];
      }
      if (mode == AMode::kE4m3) {
        const double* gr = G + i * k;
        for (std::int64_t c = 0; c < k; ++c) g += gr[c] * std::fabs(wr[c]);
      }
      if (!bias.empty()) {
        const double b = num::bf16_to_f32(bias[static_cast<std::size_t>(j)]);
        sum += b;
        abs += std::fabs(b);
      }
      const auto at = static_cast<std::size_t>(i * n + j);
      ref.value[at] = sum;
      ref.abs_sum[at] = abs;
      ref.cast_gap[at] = g;
    }
  }
  return ref;
}

Reference reference(std::span<const std::uint16_t> a, std::int64_t m, const HostQuantWeights& w,
                    std::span<const std::uint16_t> bias, const GemmTolerance& tol) {
  Reference ref = reference(a, m, w, bias, tol.reference);
  ref.weight_rounding = tol.weight_rounding;
  return ref;
}

ReferenceElement reference_element(std::span<const std::uint16_t> a_row, const HostQuantWeights& w,
                                   std::int64_t col, AMode mode) {
  ReferenceElement e;
  const std::int64_t cols = a_columns(w);  // counts k_perm: once, not per column
  std::vector<double> wd(static_cast<std::size_t>(cols)), md(wd.size());
  w.exact_rows(col, 1, wd);
  magnitude_rows(w, col, 1, wd, md);
  for (std::int64_t c = 0; c < cols; ++c) {
    const double a = activation(a_row[static_cast<std::size_t>(c)], mode);
    e.value += a * wd[static_cast<std::size_t>(c)];
    e.abs_sum += std::fabs(a) * md[static_cast<std::size_t>(c)];
    e.act_abs_sum += std::fabs(a);
  }
  return e;
}

double underflow_bound(std::int64_t k, double weight_rounding, double act_abs_sum) noexcept {
  const double weights = weight_rounding > 0.0 ? kBf16Underflow * act_abs_sum : 0.0;
  return (1.0 + kBf16Unit) *
         (kBf16Underflow + static_cast<double>(k + 8) * kAccumUnderflow + weights);
}

double element_bound(double value, double abs_sum, std::int64_t k, AMode mode,
                     double weight_rounding, double act_abs_sum) {
  const double gamma =
      static_cast<double>(k + 8) * kAccumUnit + (mode == AMode::kE4m3 ? kFp8MmaTerm : 0.0);
  const double uw = weight_rounding;
  return kBf16Unit * std::fabs(value) + (1.0 + kBf16Unit) * (gamma + uw + gamma * uw) * abs_sum +
         underflow_bound(k, weight_rounding, act_abs_sum);
}

double element_bound(const Reference& ref, std::size_t i) {
  const double act =
      ref.act_abs_sum.empty() ? 0.0 : ref.act_abs_sum[i / static_cast<std::size_t>(ref.n)];
  return element_bound(ref.value[i], ref.abs_sum[i], ref.k, ref.mode, ref.weight_rounding, act);
}

std::string Comparison::str() const {
  return fmt::format(
      "normalized error {:.3e}, ‖ref‖ {:.4g}, {} unwritten, {} nonzero; worst element "
      "C[{}, {}] = {} vs ref {} (bound {:.3g}, {:.3g}× the bound)",
      normalized, ref_norm, unwritten, nonzero, worst_at < 0 ? -1 : worst_at / n,
      worst_at < 0 ? -1 : worst_at % n, worst_out, worst_ref, worst_bound, worst);
}

namespace {

// Element i's distance from its bound, kept in c where it is the worst so far (NaN: infinitely
// far; a zero bound admits only an exact value).
void note_element(Comparison& c, std::size_t i, double out, double ref, double bound) {
  const double d = out - ref;
  const double r = std::isnan(d) ? std::numeric_limits<double>::infinity()
                   : bound > 0.0 ? std::fabs(d) / bound
                   : d == 0.0    ? 0.0
                                 : std::numeric_limits<double>::infinity();
  if (c.worst_at < 0 || r > c.worst) {
    c.worst = r;
    c.worst_at = static_cast<std::int64_t>(i);
    c.worst_out = out;
    c.worst_ref = ref;
    c.worst_bound = bound;
  }
}

}  // namespace

Comparison compare(std::span<const std::uint16_t> out, const Reference& ref, bool add_cast_gap) {
  Comparison c;
  c.n = ref.n;
  c.count = static_cast<std::int64_t>(ref.value.size());
  double err2 = 0.0, ref2 = 0.0, under2 = 0.0;
  for (std::size_t i = 0; i < ref.value.size(); ++i) {
    const double under = underflow_bound(
        ref.k, ref.weight_rounding,
        ref.act_abs_sum.empty() ? 0.0 : ref.act_abs_sum[i / static_cast<std::size_t>(ref.n)]);
    under2 += under * under;
    c.unwritten += out[i] == kPoisonBf16;
    c.nonzero += (out[i] & 0x7FFFu) != 0;
    const double o = num::bf16_to_f32(out[i]);
    const double d = o - ref.value[i];
    err2 += d * d;
    ref2 += ref.value[i] * ref.value[i];
    const double bound =
        element_bound(ref, i) + (add_cast_gap ? (1.0 + kBf16Unit) * ref.cast_gap[i] : 0.0);
    note_element(c, i, o, ref.value[i], bound);
  }
  c.ref_norm = std::sqrt(ref2);
  c.normalized = std::sqrt(err2) / c.ref_norm;
  c.underflow_norm = std::sqrt(under2);
  return c;
}

Comparison compare_f32(std::span<const float> out, const Reference& ref) {
  Comparison c;
  c.n = ref.n;
  c.count = static_cast<std::int64_t>(ref.value.size());
  double err2 = 0.0, ref2 = 0.0, under2 = 0.0;
  for (std::size_t i = 0; i < ref.value.size(); ++i) {
    const double act =
        ref.act_abs_sum.empty() ? 0.0 : ref.act_abs_sum[i / static_cast<std::size_t>(ref.n)];
    // No BF16 output: the FP32 terms of element_bound alone (its underflow without BF16's).
    const double under =
        underflow_bound(ref.k, ref.weight_rounding, act) - (1.0 + kBf16Unit) * kBf16Underflow;
    const double bound =
        element_bound(ref.value[i], ref.abs_sum[i], ref.k, ref.mode, ref.weight_rounding, act) -
        kBf16Unit * std::fabs(ref.value[i]) - (1.0 + kBf16Unit) * kBf16Underflow;
    under2 += under * under;
    std::uint32_t bits = 0;
    std::memcpy(&bits, &out[i], 4);
    c.unwritten += bits == kPoisonF32;
    c.nonzero += out[i] != 0.0f;
    const double o = out[i];
    const double d = o - ref.value[i];
    err2 += d * d;
    ref2 += ref.value[i] * ref.value[i];
    note_element(c, i, o, ref.value[i], bound);
  }
  c.ref_norm = std::sqrt(ref2);
  c.normalized = std::sqrt(err2) / c.ref_norm;
  c.underflow_norm = std::sqrt(under2);
  return c;
}

bool within(const Comparison& c, double tol) {
  return c.ref_norm > 0.0 && c.nonzero > 0 && c.unwritten == 0 &&
         c.normalized <= tol + c.underflow_norm / c.ref_norm && c.worst <= 1.0;
}

bool within(const Comparison& c, const GemmTolerance& tol) {
  const bool norm_applies = c.count >= tol.norm_min_outputs;
  return within(c, norm_applies ? tol.normalized : std::numeric_limits<double>::infinity());
}

}  // namespace metrale::toolkit
