#include "metrale/e4m3_block.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <string_view>
#include <thread>
#include <vector>

#include "core/rounding.h"
#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale {
namespace {

constexpr double kE4m3Max = num::kE4m3Max;

[[noreturn]] void fail(std::string_view api, std::string_view what) {
  throw Error(ErrorCode::kInvalidArgument, api, what);
}

// n, k > 0 and n * k fits 64 bits.
void check_shape(std::string_view api, std::string_view rows, std::int64_t n, std::int64_t k) {
  if (n <= 0) fail(api, fmt::format("{} = {} must be positive", rows, n));
  if (k <= 0) fail(api, fmt::format("k = {} must be positive", k));
  if (n > std::numeric_limits<std::int64_t>::max() / k) {
    fail(api, fmt::format("{} = {} * k = {} overflows a 64-bit element count", rows, n, k));
  }
}

// `how` names the rule with two {} for x and y; formatted only on failure, so the per-element
// accessors that check their view cost no string work.
void check_size(std::string_view api, std::string_view what, std::size_t got, std::int64_t want,
                std::string_view how, std::int64_t x, std::int64_t y) {
  if (got != static_cast<std::size_t>(want)) {
    fail(api, fmt::format("{} has {} elements, but {} needs {}", what, got,
                          fmt::format(fmt::runtime(how), x, y), want));
  }
}

// The block's scale: amax / 448 rounded to FP32. amax has at most 30 significant bits (an FP32,
// or an exact NVFP4 product), so the double quotient is never on an FP32 midpoint unless the
// exact one is, and the cast rounds as a single rounding would. Zero → 1; a quotient below the
// smallest positive float → that float, so every scale is positive.
float block_scale(double amax) {
  if (amax == 0.0) return 1.0f;
  const float s = static_cast<float>(amax / kE4m3Max);
  return std::max(s, std::numeric_limits<float>::denorm_min());
}

// The correctly rounded E4M3 of v / s. v and s carry at most 30 and 24 significant bits, so an
// inexact quotient stays about 2^-32 (relative) away from every E4M3 midpoint, far beyond the
// double division's 2^-53; rounding it to odd in FP32 keeps that side, and f32_to_e4m3 rounds
// the rest (nearest even, saturating).
std::uint8_t nearest_e4m3(double v, float s) {
  return num::f32_to_e4m3(detail::to_f32_round_odd(v / static_cast<double>(s)));
}

// Block-scaled quantization of W[n, k] whose element (row, col) is value(row, col), exact in a
// double and finite (the callers check).
template <class Value>
void quantize_blocks(std::int64_t n, std::int64_t k, Value value, std::span<std::uint8_t> codes,
                     std::span<float> scales) {
  const std::int64_t kb = e4m3_blocks(k);
  for (std::int64_t r0 = 0; r0 < n; r0 += kE4m3Block) {
    const std::int64_t r1 = std::min(n, r0 + kE4m3Block);
    for (std::int64_t c0 = 0; c0 < k; c0 += kE4m3Block) {
      const std::int64_t c1 = std::min(k, c0 + kE4m3Block);
      double amax = 0.0;
      for (std::int64_t r = r0; r < r1; ++r) {
        for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(value(r, c)));
      }
      const float s = block_scale(amax);
      scales[static_cast<std::size_t>((r0 / kE4m3Block) * kb + c0 / kE4m3Block)] = s;
      for (std::int64_t r = r0; r < r1; ++r) {
        for (std::int64_t c = c0; c < c1; ++c) {
          codes[static_cast<std::size_t>(r * k + c)] = nearest_e4m3(value(r, c), s);
        }
      }
    }
  }
}

void check_weight_outputs(std::string_view api, std::int64_t n, std::int64_t k,
                          std::span<std::uint8_t> codes, std::span<float> scales) {
  check_size(api, "codes", codes.size(), n * k, "n * k = {} * {}", n, k);
  check_size(api, "scales", scales.size(), e4m3_blocks(n) * e4m3_blocks(k),
             "ceil(n / 128) * ceil(k / 128) for n = {}, k = {}", n, k);
}

HostE4m3BlockWeights sized_weights(std::int64_t n, std::int64_t k) {
  HostE4m3BlockWeights out;
  out.n = n;
  out.k = k;
  out.codes.resize(static_cast<std::size_t>(n * k));
  out.scales.resize(static_cast<std::size_t>(e4m3_blocks(n) * e4m3_blocks(k)));
  return out;
}

void check_view(std::string_view api, const E4m3BlockWeightsView& w) {
  check_shape(api, "n", w.n, w.k);
  check_size(api, "codes", w.codes.size(), w.n * w.k, "n * k = {} * {}", w.n, w.k);
  check_size(api, "scales", w.scales.size(), e4m3_blocks(w.n) * e4m3_blocks(w.k),
             "ceil(n / 128) * ceil(k / 128) for n = {}, k = {}", w.n, w.k);
}

double view_weight(const E4m3BlockWeightsView& w, std::int64_t row, std::int64_t col) {
  const float s =
      w.scales[static_cast<std::size_t>((row / kE4m3Block) * e4m3_blocks(w.k) + col / kE4m3Block)];
  return static_cast<double>(num::e4m3_to_f32(w.codes[static_cast<std::size_t>(row * w.k + col)])) *
         static_cast<double>(s);
}

}  // namespace

std::int64_t e4m3_blocks(std::int64_t extent) noexcept {
  return extent <= 0 ? 0 : (extent - 1) / kE4m3Block + 1;
}

float E4m3BlockWeightsView::scale(std::int64_t row, std::int64_t col) const {
  constexpr std::string_view kApi = "E4m3BlockWeightsView::scale";
  check_view(kApi, *this);
  if (row < 0 || row >= n || col < 0 || col >= k) {
    fail(kApi, fmt::format("({}, {}) is outside the {} x {} weights", row, col, n, k));
  }
  return scales[static_cast<std::size_t>((row / kE4m3Block) * e4m3_blocks(k) + col / kE4m3Block)];
}

double E4m3BlockWeightsView::weight(std::int64_t row, std::int64_t col) const {
  constexpr std::string_view kApi = "E4m3BlockWeightsView::weight";
  check_view(kApi, *this);
  if (row < 0 || row >= n || col < 0 || col >= k) {
    fail(kApi, fmt::format("({}, {}) is outside the {} x {} weights", row, col, n, k));
  }
  return view_weight(*this, row, col);
}

void quantize_e4m3_block128(std::span<const float> w, std::int64_t n, std::int64_t k,
                            std::span<std::uint8_t> codes, std::span<float> scales) {
  constexpr std::string_view kApi = "quantize_e4m3_block128";
  check_shape(kApi, "n", n, k);
  check_size(kApi, "w", w.size(), n * k, "n * k = {} * {}", n, k);
  check_weight_outputs(kApi, n, k, codes, scales);
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (!std::isfinite(w[i])) {
      const auto idx = static_cast<std::int64_t>(i);
      fail(kApi, fmt::format("w[{}, {}] = {} is not finite", idx / k, idx % k, w[i]));
    }
  }
  quantize_blocks(
      n, k,
      [&](std::int64_t r, std::int64_t c) {
        return static_cast<double>(w[static_cast<std::size_t>(r * k + c)]);
      },
      codes, scales);
}

HostE4m3BlockWeights quantize_e4m3_block128(std::span<const float> w, std::int64_t n,
                                            std::int64_t k) {
  check_shape("quantize_e4m3_block128", "n", n, k);
  HostE4m3BlockWeights out = sized_weights(n, k);
  quantize_e4m3_block128(w, n, k, out.codes, out.scales);
  return out;
}

HostE4m3BlockWeights quantize_e4m3_block128_bf16(std::span<const std::uint16_t> w, std::int64_t n,
                                                 std::int64_t k) {
  constexpr std::string_view kApi = "quantize_e4m3_block128_bf16";
  check_shape(kApi, "n", n, k);
  check_size(kApi, "w", w.size(), n * k, "n * k = {} * {}", n, k);
  std::vector<float> f(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    f[i] = num::bf16_to_f32(w[i]);
    if (!std::isfinite(f[i])) {
      const auto idx = static_cast<std::int64_t>(i);
      fail(kApi, fmt::format("w[{}, {}] = {} (BF16 0x{:04X}) is not finite", idx / k, idx % k, f[i],
                             w[i]));
    }
  }
  return quantize_e4m3_block128(f, n, k);
}

HostE4m3BlockWeights requantize_e4m3_block128(const HostQuantWeights& w, int threads) {
  constexpr std::string_view kApi = "requantize_e4m3_block128";
  check_shape(kApi, "n", w.n, w.k);
  if (w.format == WeightFormat::kInt4) {
    throw Error(ErrorCode::kInvalidArgument, kApi, "it reads NVFP4 and MXFP4 weights, not int4");
  }
  const int group = group_size(w.format);
  if (w.k % group != 0) {
    fail(kApi, fmt::format("k = {} is not a multiple of {} (the {} block size)", w.k, group,
                           to_string(w.format)));
  }
  const auto code_bytes = static_cast<std::size_t>(w.n * (w.k / 2));
  const auto scale_bytes = static_cast<std::size_t>(w.n * (w.k / group));
  if (w.codes.size() != code_bytes || w.scales.size() != scale_bytes) {
    fail(kApi, fmt::format("{} weights of n = {}, k = {} need {} code bytes and {} scale bytes, "
                           "got {} and {}",
                           to_string(w.format), w.n, w.k, code_bytes, scale_bytes, w.codes.size(),
                           w.scales.size()));
  }
  // One block row (128 rows) of exact values at a time: 8 bytes a weight for 128 rows, not for
  // layers of hundreds of millions of weights, and the weights checked once, not per element.
  // Block rows are independent: each of `threads` workers takes every threads-th one, and the
  // first error (in block-row order) is thrown once all have stopped.
  HostE4m3BlockWeights out = sized_weights(w.n, w.k);
  const std::int64_t kb = e4m3_blocks(w.k), block_rows = e4m3_blocks(w.n);
  const int workers = static_cast<int>(std::clamp<std::int64_t>(threads, 1, block_rows));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(block_rows));
  const auto work = [&](int t) {
    std::vector<double> rows(static_cast<std::size_t>(std::min(w.n, kE4m3Block) * w.k));
    for (std::int64_t br = t; br < block_rows; br += workers) {
      try {
        const std::int64_t r0 = br * kE4m3Block, nr = std::min(kE4m3Block, w.n - r0);
        const std::span<double> v(rows.data(), static_cast<std::size_t>(nr * w.k));
        w.exact_rows(r0, nr, v);
        for (std::size_t i = 0; i < v.size(); ++i) {
          if (!std::isfinite(v[i])) {
            const std::int64_t r = r0 + static_cast<std::int64_t>(i) / w.k,
                               c = static_cast<std::int64_t>(i) % w.k;
            fail(kApi, fmt::format("{} weight [{}, {}] = {} is not finite (block scale {}, "
                                   "tensor scale {})",
                                   to_string(w.format), r, c, v[i], w.scale(r, c), w.tensor_scale));
          }
        }
        quantize_blocks(
            nr, w.k,
            [&](std::int64_t r, std::int64_t c) {
              return v[static_cast<std::size_t>(r * w.k + c)];
            },
            std::span<std::uint8_t>(out.codes).subspan(static_cast<std::size_t>(r0 * w.k),
                                                       static_cast<std::size_t>(nr * w.k)),
            std::span<float>(out.scales)
                .subspan(static_cast<std::size_t>(br * kb), static_cast<std::size_t>(kb)));
      } catch (...) {
        errors[static_cast<std::size_t>(br)] = std::current_exception();
        return;  // this worker's later block rows do not matter once one failed
      }
    }
  };
  {
    std::vector<std::jthread> pool;
    for (int t = 1; t < workers; ++t) pool.emplace_back(work, t);
    work(0);
  }
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

std::vector<float> dequantize(const E4m3BlockWeightsView& w) {
  check_view("dequantize", w);
  std::vector<float> out(static_cast<std::size_t>(w.n * w.k));
  for (std::int64_t r = 0; r < w.n; ++r) {
    for (std::int64_t c = 0; c < w.k; ++c) {
      out[static_cast<std::size_t>(r * w.k + c)] = static_cast<float>(view_weight(w, r, c));
    }
  }
  return out;
}

void quantize_e4m3_activations(std::span<const std::uint16_t> a, std::int64_t m, std::int64_t k,
                               std::span<std::uint8_t> codes, std::span<float> scales) {
  constexpr std::string_view kApi = "quantize_e4m3_activations";
  check_shape(kApi, "m", m, k);
  check_size(kApi, "a", a.size(), m * k, "m * k = {} * {}", m, k);
  check_size(kApi, "codes", codes.size(), m * k, "m * k = {} * {}", m, k);
  const std::int64_t kb = e4m3_blocks(k);
  check_size(kApi, "scales", scales.size(), kb * m, "ceil(k / 128) * m for m = {}, k = {}", m, k);
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (const float v = num::bf16_to_f32(a[i]); !std::isfinite(v)) {
      const auto idx = static_cast<std::int64_t>(i);
      fail(kApi,
           fmt::format("a[{}, {}] = {} (BF16 0x{:04X}) is not finite", idx / k, idx % k, v, a[i]));
    }
  }
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t b = 0; b < kb; ++b) {
      const std::int64_t c0 = b * kE4m3Block, c1 = std::min(k, c0 + kE4m3Block);
      float amax = 0.0f;
      for (std::int64_t c = c0; c < c1; ++c) {
        amax = std::max(amax, std::fabs(num::bf16_to_f32(a[static_cast<std::size_t>(r * k + c)])));
      }
      // FP32 division, as the device divides: amax / 448 never underflows to 0 for a BF16 amax
      // (the smallest is 2^-133).
      const float s = amax == 0.0f ? 1.0f : amax / num::kE4m3Max;
      scales[static_cast<std::size_t>(b * m + r)] = s;
      for (std::int64_t c = c0; c < c1; ++c) {
        const auto i = static_cast<std::size_t>(r * k + c);
        codes[i] = num::f32_to_e4m3(num::bf16_to_f32(a[i]) / s);
      }
    }
  }
}

HostE4m3Activations quantize_e4m3_activations(std::span<const std::uint16_t> a, std::int64_t m,
                                              std::int64_t k) {
  check_shape("quantize_e4m3_activations", "m", m, k);
  HostE4m3Activations out;
  out.m = m;
  out.k = k;
  out.codes.resize(static_cast<std::size_t>(m * k));
  out.scales.resize(static_cast<std::size_t>(e4m3_blocks(k) * m));
  quantize_e4m3_activations(a, m, k, out.codes, out.scales);
  return out;
}

}  // namespace metrale
