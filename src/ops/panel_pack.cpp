#include "ops/panel_pack.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "core/quant_int4.h"
#include "kernels/int4_layout.h"
#include "kernels/panel_layout.h"
#include "metrale/error.h"
#include "metrale/ops/quant_weights.h"
#include "ops/pack_source.h"

namespace metrale::ops {

namespace pl = panel_layout;

namespace {

// The 16-bit words of one column in a line from its 4 code bytes (k = 8t + 2s, 8t + 2s + 1 in
// byte s's low and high nibble): h = 0 gathers the low nibbles, h = 1 the high ones, nibble s
// of each at bits 4s (panel_layout.h).
std::uint16_t gather_nibbles(std::uint32_t bytes) {
  std::uint32_t x = bytes & 0x0F0F0F0Fu;  // nibble s at bit 8s
  x = (x | x >> 4) & 0x00FF00FFu;         // nibbles 0, 1 at bits 0, 4; 2, 3 at 16, 20
  return static_cast<std::uint16_t>(x | x >> 8);
}

// Column n (of group g, lane c) of w's codes into its lines of `codes`.
void put_column(const HostQuantWeights& w, std::int64_t g, int c, std::uint8_t* codes) {
  const std::int64_t n = g * pl::kGroupCols + c, lines = w.k / pl::kLineK, row_bytes = w.k / 2;
  const bool transposed = w.layout == WeightLayout::kTransposed;
  for (std::int64_t t = 0; t < lines; ++t) {
    std::uint32_t bytes = 0;
    if (transposed) {
      for (int s = 0; s < 4; ++s) {
        bytes |= std::uint32_t{w.codes[static_cast<std::size_t>((4 * t + s) * w.n + n)]} << (8 * s);
      }
    } else {
      std::memcpy(&bytes, w.codes.data() + n * row_bytes + 4 * t, 4);  // little-endian
    }
    std::uint8_t* line = codes + pl::line_offset(w.k, g, t);
    for (int h = 0; h < 2; ++h) {
      const std::uint16_t word = gather_nibbles(h == 0 ? bytes : bytes >> 4);
      std::memcpy(line + 2 * pl::word_of(c, h), &word, 2);
    }
  }
}

// Groups are independent: about 2 MiB of codes per thread.
std::int64_t groups_per_thread(std::int64_t k) {
  return std::max<std::int64_t>(1, (std::int64_t{1} << 21) / (8 * k));
}

}  // namespace

PackedPanelWeights pack_for_panels(const HostQuantWeights& w) {
  pack::check_source("pack_for_panels", w, pl::kPadCols, 0);
  PackedPanelWeights p;
  p.format = w.format;
  p.n = w.n;
  p.k = w.k;
  p.tensor_scale = w.tensor_scale;
  const int group = group_size(w.format);
  p.codes.assign(static_cast<std::size_t>(pl::code_bytes(w.n, w.k)), 0);
  p.scales.assign(static_cast<std::size_t>(pl::scale_bytes(w.n, w.k, group)), 0);
  const bool transposed = w.layout == WeightLayout::kTransposed;
  const std::int64_t blocks = w.k / group;
  const auto pack_groups = [&](std::int64_t g0, std::int64_t g1) {
    for (std::int64_t g = g0; g < g1; ++g) {
      for (int c = 0; c < pl::kGroupCols; ++c) {
        const std::int64_t n = g * pl::kGroupCols + c;
        if (n >= w.n) break;  // padding stays code 0, scale code 0
        put_column(w, g, c, p.codes.data());
        for (std::int64_t b = 0; b < blocks; ++b) {
          p.scales[static_cast<std::size_t>(pl::scale_offset(w.k, group, g, b) + c)] =
              transposed ? w.scales[static_cast<std::size_t>(b * w.n + n)]
                         : w.scales[static_cast<std::size_t>(n * blocks + b)];
        }
      }
    }
  };
  pack::split(pl::groups(w.n), groups_per_thread(w.k), pack_groups);
  return p;
}

bool int4_panels_ok(std::int64_t k) noexcept {
  return k > 0 && k % pl::kInt4BlockK == 0;
}

std::vector<std::uint8_t> pack_int4_codes_for_panels(const HostQuantWeights& w) {
  int4::check_weights("pack_int4_codes_for_panels", w);
  if (!int4_panels_ok(w.k)) {
    throw Error(ErrorCode::kInvalidArgument, "pack_int4_codes_for_panels",
                fmt::format("int4 weights with K = {} have no panel layout: it takes K a multiple "
                            "of {}",
                            w.k, pl::kInt4BlockK));
  }
  // Addressable once padded (as pack::check_source asks of the FP4 formats).
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 4;
  if (w.n > kMax / w.k - pl::kPadCols) {
    throw Error(ErrorCode::kInvalidArgument, "pack_int4_codes_for_panels",
                fmt::format("n = {} x k = {} is too large to address", w.n, w.k));
  }
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(pl::code_bytes(w.n, w.k)),
                                  pl::kInt4PadByte);
  pack::split(pl::groups(w.n), groups_per_thread(w.k), [&](std::int64_t g0, std::int64_t g1) {
    for (std::int64_t g = g0; g < g1; ++g) {
      for (int c = 0; c < pl::kGroupCols && g * pl::kGroupCols + c < w.n; ++c) {
        put_column(w, g, c, codes.data());
      }
    }
  });
  return codes;
}

std::vector<std::uint8_t> pack_int4_side(const HostQuantWeights& w, bool panel_order) {
  int4::check_weights("pack_int4_side", w);
  const auto side = int4_layout::side_of(w.n, w.k, w.group, !w.zeros.empty(), !w.k_perm.empty());
  std::vector<std::uint8_t> out(side.bytes, 0);
  if (panel_order) {
    const std::int64_t groups = w.k / w.group;
    for (std::int64_t row = 0; row < w.n; ++row) {
      for (std::int64_t g = 0; g < groups; ++g) {
        const auto from = static_cast<std::size_t>(row * groups + g);
        const auto to = static_cast<std::size_t>(int4_layout::panel_entry(w.n, groups, row, g));
        out[side.scales + 2 * to] = w.scales[2 * from];
        out[side.scales + 2 * to + 1] = w.scales[2 * from + 1];
        if (!w.zeros.empty()) out[side.zeros + to] = w.zeros[from];
      }
    }
  } else {
    std::copy(w.scales.begin(), w.scales.end(),
              out.begin() + static_cast<std::ptrdiff_t>(side.scales));
    std::copy(w.zeros.begin(), w.zeros.end(),
              out.begin() + static_cast<std::ptrdiff_t>(side.zeros));
  }
  for (std::size_t j = 0; j < w.k_perm.size(); ++j) {
    const auto v = static_cast<std::uint32_t>(w.k_perm[j]);
    for (int b = 0; b < 4; ++b) {
      out[side.perm + 4 * j + static_cast<std::size_t>(b)] =
          static_cast<std::uint8_t>(v >> (8 * b));
    }
  }
  return out;
}

}  // namespace metrale::ops
