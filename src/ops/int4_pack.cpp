#include "ops/int4_pack.h"

#include <fmt/format.h>

#include <cstring>

#include "core/quant_int4.h"
#include "kernels/decode_layout.h"
#include "kernels/int4_decode_layout.h"
#include "metrale/error.h"

namespace metrale::ops {

namespace dl = decode_layout;
namespace id = int4_decode;

bool int4_decode_layout_ok(std::int64_t group) noexcept {
  return id::group_ok(group);
}

PackedInt4Weights pack_int4_for_decode(const HostQuantWeights& w, std::string_view api) {
  int4::check_weights(api, w);
  if (w.layout != WeightLayout::kRowMajor) {
    throw Error(ErrorCode::kInvalidArgument, api, "int4 weights are row-major only");
  }
  if (!id::group_ok(w.group)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("int4 weights in groups of {} (K = {}) have no decode layout: it takes "
                            "groups of 32, 64 or a multiple of 128",
                            w.group, w.k));
  }
  PackedInt4Weights p;
  p.n = w.n;
  p.k = w.k;
  p.group = w.group;
  p.fp16_scales = w.fp16_scales;
  p.zero_points = !w.zeros.empty();
  p.act_order = !w.k_perm.empty();
  const id::Sizes sizes = id::sizes_of(w.n, w.k, w.group, p.act_order);
  p.codes.assign(static_cast<std::size_t>(sizes.codes), 0);
  p.side.assign(static_cast<std::size_t>(sizes.side), 0);
  const std::int64_t kb_count = dl::k_blocks(w.k), groups = w.k / w.group;
  const std::int64_t row_bytes = w.k / 2;
  // Each row's 8 K of a lane chunk (4 source bytes) go to the chunk's two words (steps 2 p and
  // 2 p + 1) at the nibbles code_slot gives: K i of the 8 is step h = i / 4, k j = i % 4.
  for (std::int64_t n = 0; n < w.n; ++n) {
    const std::uint8_t* src = w.codes.data() + n * row_bytes;
    for (std::int64_t k0 = 0; k0 < w.k; k0 += 8) {
      // k0 is a multiple of 8: its slot is step h = 0's word; step h = 1's is 8 bytes on.
      const std::int64_t word0 = id::code_slot(n, k0, kb_count).byte;
      std::uint32_t words[2] = {0, 0};
      std::memcpy(&words[0], p.codes.data() + word0, 4);
      std::memcpy(&words[1], p.codes.data() + word0 + 8, 4);
      const int upper = static_cast<int>((n % dl::kTileN) / 8 % 2);
      for (int i = 0; i < 8 && k0 + i < w.k; ++i) {
        const std::int64_t kk = k0 + i;
        const std::uint32_t q = (src[kk / 2] >> (4 * (kk % 2))) & 0xFu;
        const int j = i % 4, reg = 2 * (j / 2) + upper, nibble = reg + 4 * (j % 2);
        words[i / 4] |= q << (4 * nibble);
      }
      std::memcpy(p.codes.data() + word0, &words[0], 4);
      std::memcpy(p.codes.data() + word0 + 8, &words[1], 4);
    }
    // The scale and zero point (8 for symmetric weights) of each 32-K span, or of each K block
    // for groups of 128 and more.
    const std::int64_t step = w.group < dl::kBlockK ? 32 : dl::kBlockK;
    for (std::int64_t k0 = 0; k0 < w.k; k0 += step) {
      const id::SideSlot s = id::side_slot(n, k0, kb_count, w.group);
      const std::int64_t at = n * groups + k0 / w.group;
      std::memcpy(p.side.data() + s.scale, w.scales.data() + 2 * at, 2);
      p.side[static_cast<std::size_t>(s.zero)] = p.zero_points ? w.zeros[at] : 8;
    }
  }
  for (std::int64_t j = 0; j < static_cast<std::int64_t>(w.k_perm.size()); ++j) {
    const auto v = static_cast<std::uint32_t>(w.k_perm[j]);
    std::memcpy(p.side.data() + sizes.perm + 4 * j, &v, 4);
  }
  return p;
}

float packed_int4_weight(const PackedInt4Weights& p, std::int64_t n, std::int64_t j) {
  return id::weight(p.codes.data(), p.side.data(), n, j, dl::k_blocks(p.k), p.group, p.fp16_scales);
}

}  // namespace metrale::ops
