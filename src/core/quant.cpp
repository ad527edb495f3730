#include "metrale/quant.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>

#include "core/quant_int4.h"
#include "core/rounding.h"
#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale {

namespace {

using detail::to_f32_round_odd;

constexpr std::uint8_t kE2m1NegativeZero = 0x8;

// The nearest E2M1 code of w / scale (scale > 0), with one canonical zero: a -0 result (a small
// negative weight, or -0 itself) is stored as +0, so a zero block reads as all-zero bytes.
std::uint8_t nearest_e2m1(float w, double scale) {
  const std::uint8_t c = num::f32_to_e2m1(to_f32_round_odd(static_cast<double>(w) / scale));
  return c == kE2m1NegativeZero ? std::uint8_t{0} : c;
}

void set_nibble(std::uint8_t& byte, std::int64_t k, std::uint8_t code) {
  if (k & 1) {
    byte = static_cast<std::uint8_t>((byte & 0x0Fu) | (code << 4));
  } else {
    byte = static_cast<std::uint8_t>((byte & 0xF0u) | (code & 0x0Fu));
  }
}

// Checks the arguments of a quantizer: n, k > 0, k a multiple of the format's group,
// w.size() == n*k and every weight finite.
void check_quantize_args(std::string_view api, WeightFormat format, std::span<const float> w,
                         std::int64_t n, std::int64_t k) {
  const int group = group_size(format);
  if (n <= 0) {
    throw Error(ErrorCode::kInvalidArgument, api, fmt::format("n = {} must be positive", n));
  }
  if (k <= 0) {
    throw Error(ErrorCode::kInvalidArgument, api, fmt::format("k = {} must be positive", k));
  }
  if (k % group != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("k = {} is not a multiple of {} (the {} block size)", k, group,
                            to_string(format)));
  }
  if (n > std::numeric_limits<std::int64_t>::max() / k) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("n = {} * k = {} overflows a 64-bit element count", n, k));
  }
  if (w.size() != static_cast<std::size_t>(n * k)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("w has {} elements, but n * k = {} * {} = {}", w.size(), n, k, n * k));
  }
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (!std::isfinite(w[i])) {
      const auto idx = static_cast<std::int64_t>(i);
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("w[{}, {}] = {} is not finite", idx / k, idx % k, w[i]));
    }
  }
}

// Checks that a HostQuantWeights is consistent before reading it: sizes match n, k and the
// format's group.
void check_weights(std::string_view api, const HostQuantWeights& w) {
  if (w.format == WeightFormat::kInt4) return int4::check_weights(api, w);
  const int group = group_size(w.format);
  if (w.n <= 0 || w.k <= 0 || w.k % group != 0 ||
      w.n > std::numeric_limits<std::int64_t>::max() / w.k) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("bad shape n = {}, k = {} for {} (k must be a positive multiple of {})",
                            w.n, w.k, to_string(w.format), group));
  }
  const auto codes = static_cast<std::size_t>(w.n * (w.k / 2));
  const auto scales = static_cast<std::size_t>(w.n * (w.k / group));
  if (w.codes.size() != codes || w.scales.size() != scales) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("{} weights of n = {}, k = {} need {} code bytes and {} scale bytes, "
                    "got {} and {}",
                    to_string(w.format), w.n, w.k, codes, scales, w.codes.size(), w.scales.size()));
  }
}

std::size_t code_index(const HostQuantWeights& w, std::int64_t row, std::int64_t col) {
  return static_cast<std::size_t>(w.layout == WeightLayout::kRowMajor ? row * (w.k / 2) + (col >> 1)
                                                                      : (col >> 1) * w.n + row);
}

std::size_t scale_index(const HostQuantWeights& w, std::int64_t row, std::int64_t col) {
  const int group = group_size(w.format);
  return static_cast<std::size_t>(w.layout == WeightLayout::kRowMajor
                                      ? row * (w.k / group) + col / group
                                      : (col / group) * w.n + row);
}

std::uint8_t code_at(const HostQuantWeights& w, std::int64_t row, std::int64_t col) {
  if (w.format == WeightFormat::kInt4)
    return int4::stored_code(w, row, int4::stored_column(w, col));
  const std::uint8_t byte = w.codes[code_index(w, row, col)];
  return (col & 1) ? static_cast<std::uint8_t>(byte >> 4) : static_cast<std::uint8_t>(byte & 0xF);
}

// The decoded block scale alone (no tensor scale).
double block_scale_at(const HostQuantWeights& w, std::int64_t row, std::int64_t col) {
  if (w.format == WeightFormat::kInt4) {
    return int4::stored_scale(w, row, int4::stored_column(w, col));
  }
  const std::uint8_t s = w.scales[scale_index(w, row, col)];
  return w.format == WeightFormat::kNvfp4 ? static_cast<double>(num::e4m3_to_f32(s))
                                          : static_cast<double>(num::e8m0_to_f32(s));
}

// e2m1 × block scale × tensor scale, exact: the product of a 3-bit, a 4-bit (or power-of-two)
// and a 24-bit significand fits a double (MXFP4's 2^±127 times an FP32 included).
double exact_weight_at(const HostQuantWeights& w, std::int64_t row, std::int64_t col) {
  if (w.format == WeightFormat::kInt4) {
    return int4::stored_weight(w, row, int4::stored_column(w, col));
  }
  return static_cast<double>(num::e2m1_to_f32(code_at(w, row, col))) * block_scale_at(w, row, col) *
         static_cast<double>(w.tensor_scale);
}

// The exact weight rounded once to float.
float weight_at(const HostQuantWeights& w, std::int64_t row, std::int64_t col) {
  return static_cast<float>(exact_weight_at(w, row, col));
}

void check_index(std::string_view api, const HostQuantWeights& w, std::int64_t row,
                 std::int64_t col) {
  if (row < 0 || row >= w.n || col < 0 || col >= a_columns(w)) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("({}, {}) is outside the {} x {} weights", row, col, w.n, a_columns(w)));
  }
  check_weights(api, w);
}

float absmax_of(std::span<const float> v) {
  float m = 0.0f;
  for (const float x : v) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace

std::string_view to_string(WeightFormat format) noexcept {
  switch (format) {
    case WeightFormat::kNvfp4:
      return "nvfp4";
    case WeightFormat::kMxfp4:
      return "mxfp4";
    case WeightFormat::kInt4:
      return "int4";
  }
  return "unknown";
}

int group_size(WeightFormat format) noexcept {
  switch (format) {
    case WeightFormat::kNvfp4:
      return num::kNvfp4Group;
    case WeightFormat::kMxfp4:
      return num::kMxfp4Group;
    case WeightFormat::kInt4:
      return 0;
  }
  return 0;
}

std::uint8_t HostQuantWeights::code(std::int64_t row, std::int64_t col) const {
  check_index("HostQuantWeights::code", *this, row, col);
  return code_at(*this, row, col);
}

float HostQuantWeights::scale(std::int64_t row, std::int64_t col) const {
  check_index("HostQuantWeights::scale", *this, row, col);
  return static_cast<float>(block_scale_at(*this, row, col) * static_cast<double>(tensor_scale));
}

float HostQuantWeights::weight(std::int64_t row, std::int64_t col) const {
  check_index("HostQuantWeights::weight", *this, row, col);
  return weight_at(*this, row, col);
}

double HostQuantWeights::exact_weight(std::int64_t row, std::int64_t col) const {
  check_index("HostQuantWeights::exact_weight", *this, row, col);
  return exact_weight_at(*this, row, col);
}

void HostQuantWeights::exact_rows(std::int64_t row0, std::int64_t rows,
                                  std::span<double> out) const {
  constexpr std::string_view kApi = "HostQuantWeights::exact_rows";
  if (row0 < 0 || rows < 0 || row0 > n - rows) {
    throw Error(
        ErrorCode::kInvalidArgument, kApi,
        fmt::format("rows [{}, {}) are outside the {} rows of the weights", row0, row0 + rows, n));
  }
  const std::int64_t cols = a_columns(*this);
  if (out.size() != static_cast<std::size_t>(rows * cols)) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("out has {} values; {} rows of K = {} need {}", out.size(), rows, cols,
                            rows * cols));
  }
  if (rows == 0) return;
  check_weights(kApi, *this);
  if (format == WeightFormat::kInt4) {
    const std::vector<std::int64_t> stored = int4::stored_columns(*this);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        out[static_cast<std::size_t>(r * cols + c)] =
            int4::stored_weight(*this, row0 + r, stored[static_cast<std::size_t>(c)]);
      }
    }
    return;
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < k; ++c) {
      out[static_cast<std::size_t>(r * k + c)] = exact_weight_at(*this, row0 + r, c);
    }
  }
}

HostQuantWeights quantize_nvfp4(std::span<const float> w, std::int64_t n, std::int64_t k) {
  constexpr int kGroup = num::kNvfp4Group;
  check_quantize_args("quantize_nvfp4", WeightFormat::kNvfp4, w, n, k);
  HostQuantWeights q;
  q.format = WeightFormat::kNvfp4;
  q.layout = WeightLayout::kRowMajor;
  q.n = n;
  q.k = k;
  q.codes.assign(static_cast<std::size_t>(n * (k / 2)), 0);
  q.scales.assign(static_cast<std::size_t>(n * (k / kGroup)), 0);
  const float absmax = absmax_of(w);
  q.tensor_scale = absmax > 0.0f ? absmax / (6.0f * num::kE4m3Max) : 1.0f;
  // 6 × tensor scale is exact in double, so bamax / (6 × ts) is one correctly rounded division.
  // An exact quotient that is not an E4M3 midpoint stays about 2^-31 (relative) away from it
  // (bamax has 24 significant bits, 6 × ts × midpoint about 31), far beyond the division's
  // 2^-53, so the nearest E4M3 of the double is the nearest of the exact quotient. The same
  // holds for w / S and the E2M1 midpoints.
  const double six_ts = 6.0 * static_cast<double>(q.tensor_scale);
  for (std::int64_t row = 0; row < n; ++row) {
    for (std::int64_t b = 0; b < k / kGroup; ++b) {
      const std::span<const float> block =
          w.subspan(static_cast<std::size_t>(row * k + b * kGroup), kGroup);
      const float bamax = absmax_of(block);
      // A zero block gets the zero scale; so does one whose scale rounds below E4M3's smallest
      // subnormal (or a tensor scale that underflowed to 0): its codes stay 0.
      const std::uint8_t s =
          bamax > 0.0f ? num::f32_to_e4m3(to_f32_round_odd(static_cast<double>(bamax) / six_ts))
                       : std::uint8_t{0};
      q.scales[static_cast<std::size_t>(row * (k / kGroup) + b)] = s;
      const double scale =
          static_cast<double>(num::e4m3_to_f32(s)) * static_cast<double>(q.tensor_scale);
      if (!(scale > 0.0)) continue;
      for (int j = 0; j < kGroup; ++j) {
        const std::int64_t col = b * kGroup + j;
        set_nibble(q.codes[static_cast<std::size_t>(row * (k / 2) + (col >> 1))], col,
                   nearest_e2m1(block[static_cast<std::size_t>(j)], scale));
      }
    }
  }
  return q;
}

HostQuantWeights quantize_mxfp4(std::span<const float> w, std::int64_t n, std::int64_t k) {
  constexpr int kGroup = num::kMxfp4Group;
  check_quantize_args("quantize_mxfp4", WeightFormat::kMxfp4, w, n, k);
  HostQuantWeights q;
  q.format = WeightFormat::kMxfp4;
  q.layout = WeightLayout::kRowMajor;
  q.n = n;
  q.k = k;
  q.tensor_scale = 1.0f;
  q.codes.assign(static_cast<std::size_t>(n * (k / 2)), 0);
  q.scales.assign(static_cast<std::size_t>(n * (k / kGroup)), 0);
  for (std::int64_t row = 0; row < n; ++row) {
    for (std::int64_t b = 0; b < k / kGroup; ++b) {
      const std::span<const float> block =
          w.subspan(static_cast<std::size_t>(row * k + b * kGroup), kGroup);
      const float bamax = absmax_of(block);
      if (bamax == 0.0f) continue;  // scale byte 0 (2^-127) and zero codes
      // 2^(floor(log2(amax)) - 2) as E8M0 (bias 127); below 2^-127 it clamps to the smallest
      // scale. ilogb is exact, subnormal floats included; a finite float gives at most 127 + 125.
      const int e = std::clamp(std::ilogb(bamax) - 2 + 127, 0, 254);
      q.scales[static_cast<std::size_t>(row * (k / kGroup) + b)] = static_cast<std::uint8_t>(e);
      const double scale = std::ldexp(1.0, e - 127);
      for (int j = 0; j < kGroup; ++j) {
        const std::int64_t col = b * kGroup + j;
        set_nibble(q.codes[static_cast<std::size_t>(row * (k / 2) + (col >> 1))], col,
                   nearest_e2m1(block[static_cast<std::size_t>(j)], scale));
      }
    }
  }
  return q;
}

std::vector<float> dequantize(const HostQuantWeights& w) {
  check_weights("dequantize", w);
  std::vector<float> out(static_cast<std::size_t>(w.n * a_columns(w)));
  if (w.format == WeightFormat::kInt4) {
    std::vector<double> exact(out.size());
    w.exact_rows(0, w.n, exact);
    std::transform(exact.begin(), exact.end(), out.begin(),
                   [](double x) { return static_cast<float>(x); });
    return out;
  }
  for (std::int64_t row = 0; row < w.n; ++row) {
    for (std::int64_t col = 0; col < w.k; ++col) {
      out[static_cast<std::size_t>(row * w.k + col)] = weight_at(w, row, col);
    }
  }
  return out;
}

HostQuantWeights with_layout(const HostQuantWeights& w, WeightLayout layout) {
  check_weights("with_layout", w);
  HostQuantWeights out = w;
  out.layout = layout;
  if (layout == w.layout) return out;
  if (w.format == WeightFormat::kInt4) {
    throw Error(ErrorCode::kInvalidArgument, "with_layout",
                "int4 weights are row-major only; the transposed layout is for NVFP4 and MXFP4");
  }
  const int group = group_size(w.format);
  for (std::int64_t row = 0; row < w.n; ++row) {
    for (std::int64_t col = 0; col < w.k; ++col) {
      set_nibble(out.codes[code_index(out, row, col)], col, code_at(w, row, col));
    }
    for (std::int64_t col = 0; col < w.k; col += group) {
      out.scales[scale_index(out, row, col)] = w.scales[scale_index(w, row, col)];
    }
  }
  return out;
}

namespace {

// Refuses a slice [begin, end) of extent that is empty, outside it or off step, or weights in
// the transposed layout (a slice of either kind is contiguous per row only in the row-major one).
void check_slice(std::string_view api, const HostQuantWeights& w, std::int64_t begin,
                 std::int64_t end, std::int64_t extent, std::int64_t step) {
  if (w.layout != WeightLayout::kRowMajor) {
    throw Error(ErrorCode::kInvalidArgument, api, "the weights are transposed; slice row-major W");
  }
  if (begin < 0 || end > extent || begin >= end || begin % step != 0 || end % step != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("[{}, {}) is not a non-empty range of [0, {}) at multiples of {}",
                            begin, end, extent, step));
  }
}

}  // namespace

HostQuantWeights slice_rows(const HostQuantWeights& w, std::int64_t begin, std::int64_t end) {
  check_slice("slice_rows", w, begin, end, w.n, 1);
  if (w.format == WeightFormat::kInt4) {
    check_weights("slice_rows", w);
    return int4::slice_rows(w, begin, end);
  }
  const std::int64_t code_row = w.k / 2, scale_row = w.k / group_size(w.format);
  HostQuantWeights out = w;
  out.n = end - begin;
  out.codes.assign(w.codes.begin() + begin * code_row, w.codes.begin() + end * code_row);
  out.scales.assign(w.scales.begin() + begin * scale_row, w.scales.begin() + end * scale_row);
  return out;
}

HostQuantWeights stack_rows(std::span<const HostQuantWeights> parts) {
  constexpr std::string_view kApi = "stack_rows";
  if (parts.empty()) throw Error(ErrorCode::kInvalidArgument, kApi, "no parts to stack");
  const HostQuantWeights& first = parts[0];
  HostQuantWeights out = first;
  out.n = 0;
  out.codes.clear();
  out.scales.clear();
  out.zeros.clear();
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const HostQuantWeights& w = parts[i];
    check_weights(kApi, w);
    const auto differs = [&](std::string_view field, const std::string& got,
                             const std::string& want) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("parts[{}]: {} {}, but parts[0] has {}", i, field, got, want));
    };
    if (w.layout != WeightLayout::kRowMajor) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("parts[{}]: the transposed layout; stack row-major parts", i));
    }
    if (w.format != first.format) {
      differs("format", std::string(to_string(w.format)), std::string(to_string(first.format)));
    }
    if (w.k != first.k) differs("K", std::to_string(w.k), std::to_string(first.k));
    // Bitwise: one tensor scale multiplies every row of the stack.
    if (std::bit_cast<std::uint32_t>(w.tensor_scale) !=
        std::bit_cast<std::uint32_t>(first.tensor_scale)) {
      differs("tensor scale", fmt::format("{}", w.tensor_scale),
              fmt::format("{}", first.tensor_scale));
    }
    if (w.group != first.group)
      differs("group", std::to_string(w.group), std::to_string(first.group));
    if (w.fp16_scales != first.fp16_scales) {
      differs("scales", w.fp16_scales ? "FP16" : "BF16", first.fp16_scales ? "FP16" : "BF16");
    }
    if (w.zeros.empty() != first.zeros.empty()) {
      differs("zero points", w.zeros.empty() ? "none" : "stored",
              first.zeros.empty() ? "none" : "stored");
    }
    // One K order for every row: act-ordered parts only with parts[0]'s order (GPTQ's gate and up
    // of an expert, which see the same inputs and so sort K alike).
    if (w.k_perm != first.k_perm) {
      differs("act order",
              w.k_perm.empty() ? "none" : (first.k_perm.empty() ? "stored" : "in another K order"),
              first.k_perm.empty() ? "none" : (w.k_perm.empty() ? "one" : "its own"));
    }
    out.n += w.n;
    out.codes.insert(out.codes.end(), w.codes.begin(), w.codes.end());
    out.scales.insert(out.scales.end(), w.scales.begin(), w.scales.end());
    out.zeros.insert(out.zeros.end(), w.zeros.begin(), w.zeros.end());
  }
  return out;
}

HostQuantWeights take_rows(const HostQuantWeights& w, std::span<const std::int64_t> rows) {
  constexpr std::string_view kApi = "take_rows";
  check_weights(kApi, w);
  if (w.layout != WeightLayout::kRowMajor) {
    throw Error(ErrorCode::kInvalidArgument, kApi, "the transposed layout; take row-major rows");
  }
  if (rows.empty()) throw Error(ErrorCode::kInvalidArgument, kApi, "no rows to take");
  const auto code_row = static_cast<std::size_t>(w.k / 2);
  const std::size_t scale_row = w.scales.size() / static_cast<std::size_t>(w.n);
  const std::size_t zero_row = w.zeros.size() / static_cast<std::size_t>(w.n);
  HostQuantWeights out = w;
  out.n = static_cast<std::int64_t>(rows.size());
  out.codes.clear();
  out.scales.clear();
  out.zeros.clear();
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::int64_t r = rows[i];
    if (r < 0 || r >= w.n) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("rows[{}] = {} is outside the {} rows", i, r, w.n));
    }
    const auto at = static_cast<std::size_t>(r);
    const auto take = [&](std::vector<std::uint8_t>& to, const std::vector<std::uint8_t>& from,
                          std::size_t row) {
      to.insert(to.end(), from.begin() + static_cast<std::ptrdiff_t>(at * row),
                from.begin() + static_cast<std::ptrdiff_t>((at + 1) * row));
    };
    take(out.codes, w.codes, code_row);
    take(out.scales, w.scales, scale_row);
    take(out.zeros, w.zeros, zero_row);
  }
  return out;
}

HostQuantWeights in_stored_order(const HostQuantWeights& w) {
  constexpr std::string_view kApi = "in_stored_order";
  check_weights(kApi, w);
  if (std::find(w.k_perm.begin(), w.k_perm.end(), -1) != w.k_perm.end()) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                "the weights are a K slice (padded act order); take the whole layer's");
  }
  HostQuantWeights out = w;
  out.k_perm.clear();
  return out;
}

HostQuantWeights slice_columns(const HostQuantWeights& w, std::int64_t begin, std::int64_t end) {
  if (w.format == WeightFormat::kInt4) {
    check_weights("slice_columns", w);
    // One scale per row holds for any even split of K; groups split at their edges.
    check_slice("slice_columns", w, begin, end, w.k, w.group == w.k ? 2 : w.group);
    return int4::slice_columns(w, begin, end);
  }
  const std::int64_t group = group_size(w.format);
  check_slice("slice_columns", w, begin, end, w.k, group);
  HostQuantWeights out = w;
  out.k = end - begin;
  out.codes.clear();
  out.scales.clear();
  out.codes.reserve(static_cast<std::size_t>(w.n * out.k / 2));
  out.scales.reserve(static_cast<std::size_t>(w.n * out.k / group));
  for (std::int64_t r = 0; r < w.n; ++r) {
    const auto codes = w.codes.begin() + r * (w.k / 2);
    const auto scales = w.scales.begin() + r * (w.k / group);
    out.codes.insert(out.codes.end(), codes + begin / 2, codes + end / 2);
    out.scales.insert(out.scales.end(), scales + begin / group, scales + end / group);
  }
  return out;
}

}  // namespace metrale
