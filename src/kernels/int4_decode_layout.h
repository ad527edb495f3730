// The INT4 decode layout: INT4 weights (Note [INT4 weights]) rearranged at upload
// (ops/int4_pack.h) into the order gemm_int4_decode reads them. The codes keep the tile grid of
// the FP4 decode layout (kernels/decode_layout.h: 32 rows by 128 K per warp step, a lane's four
// 16-byte chunks per K block, each 32-bit word one m16n8k16 A fragment), with K arranged so that
// the two MMA steps of a chunk cover one 32-K span: a group of 32 or more never splits a span,
// and the kernel can scale each span's FP32 sum instead of each weight. A word becomes BF16 by
// exponent bias: nibble q masked under 0x4300 reads 128 + q exactly, and one subtraction of
// 128 + z leaves q - z, exact (Note [INT4 decode layout]). Host and device code alike.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/decode_layout.h"
#include "metrale/numerics.h"  // METRALE_HD

namespace metrale::int4_decode {

namespace dl = metrale::decode_layout;

// What a kernel that reads this layout publishes as <entry>_layout (kernels/published.def).
inline constexpr std::uint32_t kLayoutId = 2;

// The groups the layout takes: 32, 64 or a multiple of 128 (per channel where K is one), so that
// a 32-K span lies inside one group and a K block holds 1, 2 or 4 of them.
METRALE_HD bool group_ok(std::int64_t group) {
  return group == 32 || group == 64 || (group > 0 && group % 128 == 0);
}

// Scale entries per row and K block: one per 32-K span for groups of 32 and 64 (a group of 64
// fills two), one for a group of 128 or more (repeated in each K block of the group: 3 bytes per
// 128 weights). Two shapes keep the kernel to two variants.
METRALE_HD int entries(std::int64_t group) {
  return group >= dl::kBlockK ? 1 : 4;
}

// Bytes of one tile x K block of the side buffer: the scales [g 8][r 4][entry] (2 bytes, BF16 or
// FP16 as the weights came), then the zero points [g][r][entry] (1 byte; symmetric weights store
// 8). Lane (g, t) reads its 4 rows' entries as one run of 8 e bytes and one of 4 e bytes.
METRALE_HD constexpr std::int64_t side_block_bytes(int e) {
  return 3 * 32 * e;
}

// The two device buffers' sizes and where the act order's permutation (int32 [K], stored column j
// holds k_perm[j]) starts in the side buffer, 16-byte aligned.
struct Sizes {
  std::int64_t codes = 0, side = 0, perm = 0;
};
METRALE_HD Sizes sizes_of(std::int64_t n, std::int64_t k, std::int64_t group, bool act_order) {
  Sizes s;
  s.codes = dl::code_bytes(n, k);
  s.perm = dl::padded_n(n) / dl::kTileN * dl::k_blocks(k) * side_block_bytes(entries(group));
  s.side = s.perm + (act_order ? 4 * k : 0);
  return s;
}

// ---- where stored column k of row n sits ----

// Lane (g, t) holds rows g + 8 r (r = 0..3) as in the FP4 layout, and of each K block the spans
// p = 0..3 of 32 K: its 8 K [32 p + 8 t, 32 p + 8 t + 8), which MMA steps 2 p (the first 4) and
// 2 p + 1 (the last 4) take, in k pairs (4 h, 4 h + 1) and (4 h + 2, 4 h + 3) as the FP4 layout's
// steps do; chunk p of the lane is those two steps, one word per step and row tile. So the lane's
// activations for chunk p are 8 consecutive BF16, one 16-byte load.
//
// In a word, A fragment register j (0: row g, k pair 0; 1: row g + 8, pair 0; 2: row g, pair 1;
// 3: row g + 8, pair 1) takes nibble j for its low half and nibble j + 4 for its high half, so
// register j is (word >> 4 j) & 0x000F000F under the exponent bias.
struct CodeSlot {
  std::int64_t byte = 0;  // of the 32-bit word in the codes buffer
  int nibble = 0;         // 0..7 within the word
  int reg = 0, half = 0;  // the A fragment register and its BF16 half
};

METRALE_HD CodeSlot code_slot(std::int64_t n, std::int64_t k, std::int64_t kb_count) {
  const std::int64_t tile = n / dl::kTileN, kb = k / dl::kBlockK;
  const int nl = static_cast<int>(n % dl::kTileN), kl = static_cast<int>(k % dl::kBlockK);
  const int g = nl % 8, r = nl / 8, p = kl / 32, t = (kl % 32) / 8, h = (kl % 8) / 4, j = kl % 4;
  const int lane = 4 * g + t, rt = r / 2, upper = r % 2;
  CodeSlot slot;
  slot.byte = (tile * kb_count + kb) * dl::kTileBlockBytes + p * (dl::kLanes * dl::kChunkBytes) +
              lane * dl::kChunkBytes + 4 * (2 * h + rt);
  slot.reg = 2 * (j / 2) + upper;
  slot.half = j % 2;
  slot.nibble = slot.reg + 4 * slot.half;
  return slot;
}

// The side-buffer bytes of row n's scale (2 bytes) and zero point (1 byte) for stored column k:
// entry (k % 128) / 32 of the K block for groups under 128, else entry 0.
struct SideSlot {
  std::int64_t scale = 0, zero = 0;
};
METRALE_HD SideSlot side_slot(std::int64_t n, std::int64_t k, std::int64_t kb_count,
                              std::int64_t group) {
  const int e = entries(group);
  const std::int64_t tile = n / dl::kTileN, kb = k / dl::kBlockK;
  const int nl = static_cast<int>(n % dl::kTileN), g = nl % 8, r = nl / 8;
  const int entry = e == 1 ? 0 : static_cast<int>((k % dl::kBlockK) / 32);
  const std::int64_t block = (tile * kb_count + kb) * side_block_bytes(e);
  SideSlot s;
  s.scale = block + 2 * ((g * 4 + r) * e + entry);
  s.zero = block + 64 * e + (g * 4 + r) * e + entry;
  return s;
}

// ---- the dequantization of one word ----

// Register j of a word under the exponent bias: BF16 0x4300 is 128 with a unit of 1 in its last
// mantissa bit, so a nibble q placed in the 4 low mantissa bits reads 128 + q, exact.
inline constexpr std::uint32_t kNibbleMask = 0x000F000Fu;
inline constexpr std::uint32_t kBias = 0x43004300u;

METRALE_HD void word_fields(std::uint32_t w, std::uint32_t (&r)[4]) {
  for (int j = 0; j < 4; ++j) r[j] = ((w >> (4 * j)) & kNibbleMask) | kBias;
}

// The pair (128 + z, 128 + z) a register's fields are reduced by: q - z, exact in BF16.
METRALE_HD std::uint32_t zero_pair(std::uint32_t z) {
  return (z | (z << 16)) | kBias;
}

// A scale's 2 stored bytes as a float (BF16 or FP16), exact.
METRALE_HD float scale_value(std::uint16_t bits, bool fp16) {
  return fp16 ? num::f16_to_f32(bits) : num::bf16_to_f32(bits);
}

// Stored W[n, j] as the kernel computes it from the two buffers: (q - z) exact in BF16, times
// its scale in FP32 (the kernel applies the scale to each span's sum; this is the same product
// term by term). For host readers: the packer's read-back and the CPU twins.
inline float weight(const std::uint8_t* codes, const std::uint8_t* side, std::int64_t n,
                    std::int64_t j, std::int64_t kb_count, std::int64_t group, bool fp16) {
  const CodeSlot c = code_slot(n, j, kb_count);
  std::uint32_t word = 0;
  std::memcpy(&word, codes + c.byte, 4);
  std::uint32_t fields[4];
  word_fields(word, fields);
  const SideSlot s = side_slot(n, j, kb_count, group);
  const std::uint32_t z = side[s.zero];
  const std::uint32_t q_minus_z = num::bf16x2_sub(fields[c.reg], zero_pair(z));
  std::uint16_t bits = 0;
  std::memcpy(&bits, side + s.scale, 2);
  return num::bf16_to_f32(static_cast<std::uint16_t>(q_minus_z >> (16 * c.half))) *
         scale_value(bits, fp16);
}

}  // namespace metrale::int4_decode
