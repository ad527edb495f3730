#include "core/quant_int4.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale {

bool int4_group_ok(std::int64_t group, std::int64_t k) noexcept {
  if (group <= 0 || k <= 0 || k % group != 0) return false;
  return group == 32 || group == 64 || group % 128 == 0 || group == k;
}

std::int64_t a_columns(const HostQuantWeights& w) noexcept {
  if (w.format != WeightFormat::kInt4 || w.k_perm.empty()) return w.k;
  return static_cast<std::int64_t>(
      std::count_if(w.k_perm.begin(), w.k_perm.end(), [](std::int32_t v) { return v != -1; }));
}

namespace int4 {
namespace {

std::int64_t groups_of(const HostQuantWeights& w) {
  return w.k / w.group;
}

std::uint16_t scale_bits(const HostQuantWeights& w, std::size_t index) {
  return static_cast<std::uint16_t>(w.scales[2 * index] | (w.scales[2 * index + 1] << 8));
}

float decode_scale(bool fp16, std::uint16_t bits) {
  return fp16 ? num::f16_to_f32(bits) : num::bf16_to_f32(bits);
}

std::uint16_t encode_scale(bool fp16, float s) {
  return fp16 ? num::f32_to_f16(s) : num::f32_to_bf16(s);
}

void set_code(std::vector<std::uint8_t>& codes, std::int64_t k, std::int64_t row, std::int64_t col,
              std::uint8_t code) {
  std::uint8_t& byte = codes[static_cast<std::size_t>(row * (k / 2) + (col >> 1))];
  byte = (col & 1) ? static_cast<std::uint8_t>((byte & 0x0Fu) | (code << 4))
                   : static_cast<std::uint8_t>((byte & 0xF0u) | (code & 0x0Fu));
}

// W's columns [begin, end) of act-ordered weights (Note [Act order across ranks]): the stored
// columns whose k_perm falls in the range, in their stored order (so each group's stay together),
// each group's run padded with columns of its zero point to whole blocks of 32 K; groups of 32,
// each block the scale and zero point of its group; k_perm the range's own columns, -1 on the
// padding.
HostQuantWeights slice_act_ordered(const HostQuantWeights& w, std::int64_t begin,
                                   std::int64_t end) {
  constexpr std::int64_t kBlock = 32;
  if (a_columns(w) != w.k) {
    throw Error(ErrorCode::kInvalidArgument, "slice_columns",
                fmt::format("these int4 weights are a K slice already ({} columns of W padded to "
                            "K = {}); slice the whole layer's weights",
                            a_columns(w), w.k));
  }
  // from[i]: the stored column of w that output column i holds, -1 for padding.
  std::vector<std::int64_t> from;
  std::int64_t run_group = -1;
  const auto pad_run = [&] {
    while (from.size() % kBlock != 0) from.push_back(-1);
  };
  for (std::int64_t j = 0; j < w.k; ++j) {
    const std::int32_t v = w.k_perm[static_cast<std::size_t>(j)];
    if (v < begin || v >= end) continue;
    if (j / w.group != run_group) {
      pad_run();
      run_group = j / w.group;
    }
    from.push_back(j);
  }
  pad_run();
  HostQuantWeights out = w;
  out.k = static_cast<std::int64_t>(from.size());
  out.group = kBlock;
  const std::int64_t blocks = out.k / kBlock;
  out.codes.assign(static_cast<std::size_t>(w.n * (out.k / 2)), 0);
  out.scales.assign(static_cast<std::size_t>(2 * w.n * blocks), 0);
  if (!w.zeros.empty()) out.zeros.assign(static_cast<std::size_t>(w.n * blocks), 0);
  out.k_perm.assign(from.size(), -1);
  for (std::size_t i = 0; i < from.size(); ++i) {
    if (from[i] >= 0) {
      out.k_perm[i] =
          static_cast<std::int32_t>(w.k_perm[static_cast<std::size_t>(from[i])] - begin);
    }
  }
  for (std::int64_t row = 0; row < w.n; ++row) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      // A block's first column is its group's (runs start on a block).
      const std::int64_t j0 = from[static_cast<std::size_t>(b * kBlock)];
      const auto src = static_cast<std::size_t>(row * groups_of(w) + j0 / w.group),
                 dst = static_cast<std::size_t>(row * blocks + b);
      out.scales[2 * dst] = w.scales[2 * src];
      out.scales[2 * dst + 1] = w.scales[2 * src + 1];
      if (!w.zeros.empty()) out.zeros[dst] = w.zeros[src];
      const auto zero = static_cast<std::uint8_t>(stored_zero(w, row, j0));
      for (std::int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i) {
        const std::int64_t j = from[static_cast<std::size_t>(i)];
        set_code(out.codes, out.k, row, i, j < 0 ? zero : stored_code(w, row, j));
      }
    }
  }
  return out;
}

}  // namespace

void check_weights(std::string_view api, const HostQuantWeights& w) {
  if (w.layout != WeightLayout::kRowMajor) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "int4 weights are row-major only (codes [N, K/2]); the transposed layout is for "
                "NVFP4 and MXFP4");
  }
  if (w.n <= 0 || w.k <= 0 || w.k % 2 != 0 ||
      w.n > std::numeric_limits<std::int64_t>::max() / w.k) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("bad shape n = {}, k = {} for int4 (k must be positive and even)", w.n, w.k));
  }
  if (!int4_group_ok(w.group, w.k)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("int4 group {} for K = {}: the group must divide K and be 32, 64, a "
                            "multiple of 128 or K itself",
                            w.group, w.k));
  }
  const auto codes = static_cast<std::size_t>(w.n * (w.k / 2));
  const auto groups = static_cast<std::size_t>(w.n * groups_of(w));
  if (w.codes.size() != codes || w.scales.size() != 2 * groups) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("int4 weights of n = {}, k = {}, group {} need {} code bytes and {} "
                            "scale bytes, got {} and {}",
                            w.n, w.k, w.group, codes, 2 * groups, w.codes.size(), w.scales.size()));
  }
  if (!w.zeros.empty()) {
    if (w.zeros.size() != groups) {
      throw Error(
          ErrorCode::kInvalidArgument, api,
          fmt::format("int4 zero points are {} bytes; [N, K/group] is {}", w.zeros.size(), groups));
    }
    const auto bad = std::find_if(w.zeros.begin(), w.zeros.end(), [](auto z) { return z > 15; });
    if (bad != w.zeros.end()) {
      const auto i = static_cast<std::int64_t>(bad - w.zeros.begin());
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("int4 zero point [{}, {}] is {}; a 4-bit zero point is 0..15",
                              i / groups_of(w), i % groups_of(w), *bad));
    }
  }
  if (!w.k_perm.empty()) {
    if (w.k_perm.size() != static_cast<std::size_t>(w.k)) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("k_perm has {} entries; K = {}", w.k_perm.size(), w.k));
    }
    // The entries other than -1 (a K slice's padding) are a permutation of [0, a).
    const std::int64_t a = a_columns(w);
    std::vector<bool> seen(static_cast<std::size_t>(w.k));
    for (std::size_t j = 0; j < w.k_perm.size(); ++j) {
      const std::int32_t v = w.k_perm[j];
      if (v == -1) continue;
      if (v < 0 || v >= a || seen[static_cast<std::size_t>(v)]) {
        throw Error(ErrorCode::kInvalidArgument, api,
                    fmt::format("k_perm[{}] = {} is {}; k_perm must be a permutation of [0, {}) "
                                "with -1 for padding columns",
                                j, v, v < 0 || v >= a ? "outside A's columns" : "repeated", a));
      }
      seen[static_cast<std::size_t>(v)] = true;
    }
    if (a == 0) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  "k_perm is -1 throughout: the weights have no column of W");
    }
  }
  if (w.tensor_scale != 1.0f) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("int4 weights have no tensor scale, but it is {}", w.tensor_scale));
  }
}

std::int64_t stored_column(const HostQuantWeights& w, std::int64_t k) {
  if (w.k_perm.empty()) return k;
  const auto it = std::find(w.k_perm.begin(), w.k_perm.end(), static_cast<std::int32_t>(k));
  return static_cast<std::int64_t>(it - w.k_perm.begin());
}

std::vector<std::int64_t> stored_columns(const HostQuantWeights& w) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(a_columns(w)));
  if (w.k_perm.empty()) {
    std::iota(out.begin(), out.end(), std::int64_t{0});
  } else {
    for (std::size_t j = 0; j < w.k_perm.size(); ++j) {
      if (w.k_perm[j] >= 0)
        out[static_cast<std::size_t>(w.k_perm[j])] = static_cast<std::int64_t>(j);
    }
  }
  return out;
}

std::uint8_t stored_code(const HostQuantWeights& w, std::int64_t row, std::int64_t j) {
  const std::uint8_t byte = w.codes[static_cast<std::size_t>(row * (w.k / 2) + (j >> 1))];
  return (j & 1) ? static_cast<std::uint8_t>(byte >> 4) : static_cast<std::uint8_t>(byte & 0xF);
}

float stored_scale(const HostQuantWeights& w, std::int64_t row, std::int64_t j) {
  const auto index = static_cast<std::size_t>(row * groups_of(w) + j / w.group);
  return decode_scale(w.fp16_scales, scale_bits(w, index));
}

int stored_zero(const HostQuantWeights& w, std::int64_t row, std::int64_t j) {
  if (w.zeros.empty()) return 8;
  return w.zeros[static_cast<std::size_t>(row * groups_of(w) + j / w.group)];
}

double stored_weight(const HostQuantWeights& w, std::int64_t row, std::int64_t j) {
  return static_cast<double>(stored_code(w, row, j) - stored_zero(w, row, j)) *
         static_cast<double>(stored_scale(w, row, j));
}

HostQuantWeights slice_rows(const HostQuantWeights& w, std::int64_t begin, std::int64_t end) {
  const std::int64_t code_row = w.k / 2, groups = groups_of(w);
  HostQuantWeights out = w;
  out.n = end - begin;
  out.codes.assign(w.codes.begin() + begin * code_row, w.codes.begin() + end * code_row);
  out.scales.assign(w.scales.begin() + 2 * begin * groups, w.scales.begin() + 2 * end * groups);
  if (!w.zeros.empty()) {
    out.zeros.assign(w.zeros.begin() + begin * groups, w.zeros.begin() + end * groups);
  }
  return out;
}

HostQuantWeights slice_columns(const HostQuantWeights& w, std::int64_t begin, std::int64_t end) {
  if (!w.k_perm.empty()) return slice_act_ordered(w, begin, end);
  // One scale per row: every slice keeps it.
  const bool per_row = w.group == w.k;
  const std::int64_t groups = groups_of(w), g0 = per_row ? 0 : begin / w.group,
                     g1 = per_row ? 1 : end / w.group;
  HostQuantWeights out = w;
  out.k = end - begin;
  if (per_row) out.group = out.k;
  out.codes.clear();
  out.scales.clear();
  out.zeros.clear();
  for (std::int64_t r = 0; r < w.n; ++r) {
    const auto codes = w.codes.begin() + r * (w.k / 2);
    const auto scales = w.scales.begin() + 2 * r * groups;
    out.codes.insert(out.codes.end(), codes + begin / 2, codes + end / 2);
    out.scales.insert(out.scales.end(), scales + 2 * g0, scales + 2 * g1);
    if (!w.zeros.empty()) {
      const auto zeros = w.zeros.begin() + r * groups;
      out.zeros.insert(out.zeros.end(), zeros + g0, zeros + g1);
    }
  }
  return out;
}

}  // namespace int4

HostQuantWeights quantize_int4(std::span<const float> w, std::int64_t n, std::int64_t k,
                               std::int64_t group, bool zero_points, bool fp16_scales) {
  constexpr std::string_view kApi = "quantize_int4";
  if (n <= 0 || k <= 0 || k % 2 != 0 || n > std::numeric_limits<std::int64_t>::max() / k) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("bad shape n = {}, k = {} (k must be positive and even)", n, k));
  }
  if (!int4_group_ok(group, k)) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("group {} for K = {}: it must divide K and be 32, 64, a multiple of "
                            "128 or K itself",
                            group, k));
  }
  if (w.size() != static_cast<std::size_t>(n * k)) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("w has {} elements, but n * k = {} * {} = {}", w.size(), n, k, n * k));
  }
  HostQuantWeights q;
  q.format = WeightFormat::kInt4;
  q.n = n;
  q.k = k;
  q.group = group;
  q.fp16_scales = fp16_scales;
  const std::int64_t groups = k / group;
  q.codes.assign(static_cast<std::size_t>(n * (k / 2)), 0);
  q.scales.assign(static_cast<std::size_t>(2 * n * groups), 0);
  if (zero_points) q.zeros.assign(static_cast<std::size_t>(n * groups), 0);
  for (std::int64_t row = 0; row < n; ++row) {
    for (std::int64_t g = 0; g < groups; ++g) {
      const auto block =
          w.subspan(static_cast<std::size_t>(row * k + g * group), static_cast<std::size_t>(group));
      float lo = 0.0f, hi = 0.0f;
      for (const float x : block) {
        if (!std::isfinite(x)) {
          throw Error(
              ErrorCode::kInvalidArgument, kApi,
              fmt::format("w[{}, {}] = {} is not finite", row, g * group + (&x - block.data()), x));
        }
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      const float wanted =
          zero_points ? (hi - lo) / 15.0f : std::max(std::fabs(lo), std::fabs(hi)) / 7.0f;
      const std::uint16_t bits = int4::encode_scale(fp16_scales, wanted);
      const double scale = int4::decode_scale(fp16_scales, bits);
      const auto index = static_cast<std::size_t>(row * groups + g);
      q.scales[2 * index] = static_cast<std::uint8_t>(bits & 0xFF);
      q.scales[2 * index + 1] = static_cast<std::uint8_t>(bits >> 8);
      int zero = 8;
      if (zero_points) {
        zero = scale > 0.0 && std::isfinite(scale)
                   ? static_cast<int>(std::clamp(std::nearbyint(-lo / scale), 0.0, 15.0))
                   : 0;
        q.zeros[index] = static_cast<std::uint8_t>(zero);
      }
      for (std::int64_t j = 0; j < group; ++j) {
        const double x = block[static_cast<std::size_t>(j)];
        const double code =
            scale > 0.0 && std::isfinite(scale) ? std::nearbyint(x / scale) + zero : zero;
        int4::set_code(q.codes, k, row, g * group + j,
                       static_cast<std::uint8_t>(std::clamp(code, 0.0, 15.0)));
      }
    }
  }
  return q;
}

HostQuantWeights with_act_order(const HostQuantWeights& w, std::span<const std::int32_t> g_idx) {
  constexpr std::string_view kApi = "with_act_order";
  int4::check_weights(kApi, w);
  if (!w.k_perm.empty()) {
    throw Error(ErrorCode::kInvalidArgument, kApi, "the weights are act-ordered already");
  }
  if (g_idx.size() != static_cast<std::size_t>(w.k)) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("g_idx has {} entries; K = {}", g_idx.size(), w.k));
  }
  const std::int64_t groups = w.k / w.group;
  std::vector<std::int64_t> count(static_cast<std::size_t>(groups));
  bool ordered = true;
  for (std::int64_t k = 0; k < w.k; ++k) {
    const std::int32_t g = g_idx[static_cast<std::size_t>(k)];
    if (g < 0 || g >= groups) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("g_idx[{}] = {} is outside the {} groups of K = {} by {}", k, g,
                              groups, w.k, w.group));
    }
    ++count[static_cast<std::size_t>(g)];
    ordered = ordered && g == k / w.group;
  }
  for (std::int64_t g = 0; g < groups; ++g) {
    if (count[static_cast<std::size_t>(g)] != w.group) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("g_idx puts {} columns in group {}; every group holds {}",
                              count[static_cast<std::size_t>(g)], g, w.group));
    }
  }
  if (ordered) return w;
  std::vector<std::int32_t> perm(static_cast<std::size_t>(w.k));
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](std::int32_t a, std::int32_t b) {
    return g_idx[static_cast<std::size_t>(a)] < g_idx[static_cast<std::size_t>(b)];
  });
  HostQuantWeights out = w;
  out.k_perm = perm;
  for (std::int64_t row = 0; row < w.n; ++row) {
    for (std::int64_t j = 0; j < w.k; ++j) {
      int4::set_code(out.codes, w.k, row, j,
                     int4::stored_code(w, row, perm[static_cast<std::size_t>(j)]));
    }
  }
  return out;
}

}  // namespace metrale
