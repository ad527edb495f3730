// The decode layout: NVFP4 and MXFP4 weights rearranged at upload (ops/decode_pack.h) into the
// order in which gemm_decode_packed reads them, so that a lane's codes for two MMA steps are one
// 16-byte load and one 32-bit word dequantizes into one m16n8k16 A fragment with one integer
// instruction per register (see Note [decode layout] in docs/NOTES.md). Everything here is
// __host__ __device__: the kernel, the packer and the host tests share one definition.
#pragma once

#include <cstdint>
#include <cstring>

#include "metrale/numerics.h"  // METRALE_HD

namespace metrale::decode_layout {

// What a kernel that reads this layout publishes as <entry>_layout (kernels/published.def).
inline constexpr std::uint32_t kLayoutId = 1;

// ---- the grid of tiles ----

inline constexpr int kTileN = 32;    // weight rows per tile: a block's output columns
inline constexpr int kBlockK = 128;  // K per warp step: 4 lanes t of 32 K each
inline constexpr int kLanes = 32;
inline constexpr int kWordsPerLane = 16;  // 8 MMA steps x 2 row tiles of 16
inline constexpr int kChunkBytes = 16;    // one lane's load: 2 steps x 2 row tiles
inline constexpr int kChunks = 4;         // loads per lane per K block
inline constexpr int kTileBlockBytes = kTileN * kBlockK / 2;  // codes of one tile x K block
inline constexpr int kTableEntries = 256;                     // one BF16 pair per scale code
inline constexpr int kTableBytes = kTableEntries * 4;

// N and K rounded up to whole tiles and K blocks; the padding holds code 0 and scale code 0,
// so it adds exact zeros (both formats' code 0 is a finite scale).
METRALE_HD std::int64_t padded_n(std::int64_t n) {
  return (n + kTileN - 1) / kTileN * kTileN;
}
METRALE_HD std::int64_t padded_k(std::int64_t k) {
  return (k + kBlockK - 1) / kBlockK * kBlockK;
}
METRALE_HD std::int64_t k_blocks(std::int64_t k) {
  return padded_k(k) / kBlockK;
}

// Scale codes per lane per K block: its 4 rows x 2 groups of 16 (NVFP4) or x 1 group of 32.
METRALE_HD int scale_bytes_per_lane(bool mx) {
  return mx ? 4 : 8;
}

// Bytes of the two device buffers: the codes, and the scales (the 256-entry table of BF16 pairs,
// then the scale codes).
METRALE_HD std::int64_t code_bytes(std::int64_t n, std::int64_t k) {
  return padded_n(n) * padded_k(k) / 2;
}
METRALE_HD std::int64_t scale_bytes(std::int64_t n, std::int64_t k, bool mx) {
  return kTableBytes +
         padded_n(n) / kTileN * k_blocks(k) * kLanes * std::int64_t{scale_bytes_per_lane(mx)};
}

// ---- where W[n, k] sits ----

// Lane (g, t) of the warp that multiplies a tile holds rows g + 8 r (r = 0..3: row tile r / 2,
// its upper half when r is odd) and the 32 K [32 t, 32 t + 32) of each K block; MMA step s
// (0..7) takes K 4 s .. 4 s + 3 of those (the MMA sums its 16 k in any order, so the
// activations need only the same permutation: lane t's B registers for step s are its BF16 words
// 2 s and 2 s + 1 of those 32 K, k pairs (4s, 4s+1) and (4s+2, 4s+3)).
//
// A fragment register j of step s (PTX ISA, m16n8k16): j = 0 row g, k pair 0; j = 1 row g + 8,
// pair 0; j = 2 row g, pair 1; j = 3 row g + 8, pair 1 (the low half the pair's first k).
struct CodeSlot {
  std::int64_t byte = 0;  // of the 32-bit word in the codes buffer
  int reg = 0;            // A fragment register the word dequantizes into
  int half = 0;           // 0: low BF16 of the register, 1: high
};

METRALE_HD CodeSlot code_slot(std::int64_t n, std::int64_t k, std::int64_t kb_count) {
  const std::int64_t tile = n / kTileN, kb = k / kBlockK;
  const int nl = static_cast<int>(n % kTileN), kl = static_cast<int>(k % kBlockK);
  const int g = nl % 8, r = nl / 8, t = kl / 32, s = (kl % 32) / 4, j = kl % 4;
  const int lane = 4 * g + t, rt = r / 2, upper = r % 2;
  // Chunk s / 2 of the lane holds steps s & ~1 and s | 1, each as its row tile 0 and 1 words.
  const int chunk = s / 2, word = 2 * (s % 2) + rt;
  CodeSlot slot;
  slot.byte = (tile * kb_count + kb) * kTileBlockBytes + chunk * (kLanes * kChunkBytes) +
              lane * kChunkBytes + 4 * word;
  slot.reg = 2 * (j / 2) + upper;
  slot.half = j % 2;
  return slot;
}

// Where the scale code of row n for K k sits in the scales buffer (after the table): lane (g, t)
// keeps its 8 (NVFP4) or 4 (MXFP4) codes together, byte 2 r + group (NVFP4: group s / 4) or r.
METRALE_HD std::int64_t scale_byte(std::int64_t n, std::int64_t k, std::int64_t kb_count, bool mx) {
  const std::int64_t tile = n / kTileN, kb = k / kBlockK;
  const int nl = static_cast<int>(n % kTileN), kl = static_cast<int>(k % kBlockK);
  const int g = nl % 8, r = nl / 8, t = kl / 32, group = (kl % 32) / 16;
  const int lane = 4 * g + t, per = scale_bytes_per_lane(mx);
  return kTableBytes + (tile * kb_count + kb) * kLanes * per + lane * per +
         (mx ? r : 2 * r + group);
}

// ---- the dequantization of one word ----

// A BF16 pair's E2M1 fields: sign at bit 15, e1 e0 m at bits 8..6 of each half. Masked into an
// otherwise zero pair they read as the E2M1 value times 2^-126 (exponent field e1 e0: 2^(e-127)
// times 1.m, and 0.m times 2^-126 for e = 0, the subnormal 0.5 included).
inline constexpr std::uint32_t kFieldMask = 0x81C081C0u;
inline constexpr int kValueExponent = -126;

// Register j (0..2) of a word is the word rotated right by kRotate[j], masked. Register 3 takes
// the word's own bits at kKeepMask and, at kFieldMask & ~kKeepMask (bits 8 and 24), the word
// rotated right by kRotate3. These four shapes cover the 32 bits of a word exactly once; no
// three rotations of one mask can (Note [decode layout]).
inline constexpr int kRotate[3] = {2, 6, 12};
inline constexpr int kRotate3 = 8;
inline constexpr std::uint32_t kKeepMask = 0x80C080C0u;
inline constexpr std::uint32_t kRotatedMask3 = kFieldMask & ~kKeepMask;

METRALE_HD std::uint32_t rotate_right(std::uint32_t w, int k) {
  return (w >> k) | (w << (32 - k));
}

// The word's four registers as BF16 pairs of E2M1 values times 2^-126, in plain operations: the
// reference the kernel's instruction sequence (cuda/kernels/decode_packed.cuh) and the packer
// are tested against.
METRALE_HD void dequant_word_fields(std::uint32_t w, std::uint32_t (&r)[4]) {
  for (int j = 0; j < 3; ++j) r[j] = rotate_right(w, kRotate[j]) & kFieldMask;
  r[3] = (w & kKeepMask) | (rotate_right(w, kRotate3) & kRotatedMask3);
}

// The bit of the word that holds bit `bit` (0 m, 1 e0, 2 e1, 3 sign) of the code in register
// `reg`, half `half`: the inverse of dequant_word_fields, for the packer.
METRALE_HD int code_bit_position(int reg, int half, int bit) {
  constexpr int kField[4] = {6, 7, 8, 15};
  const int out = kField[bit] + 16 * half;
  int rot = 0;
  if (reg < 3) {
    rot = kRotate[reg];
  } else if (((kRotatedMask3 >> out) & 1u) != 0) {
    rot = kRotate3;
  }
  return (out + rot) % 32;
}

// W[n, k] times 2^-fold, as BF16 bits, the way gemm_decode_packed computes it from a codes and
// a scales buffer in this layout (the word's field pair times its table pair, one BF16
// multiply). For host readers: the packer's read-back and the fake driver's kernel.
inline std::uint16_t weight_bits(const std::uint8_t* codes, const std::uint8_t* scales,
                                 std::int64_t n, std::int64_t k, std::int64_t kb_count, bool mx) {
  const CodeSlot slot = code_slot(n, k, kb_count);
  std::uint32_t word = 0, pair = 0;
  std::memcpy(&word, codes + slot.byte, 4);
  std::memcpy(&pair, scales + 4 * std::int64_t{scales[scale_byte(n, k, kb_count, mx)]}, 4);
  std::uint32_t fields[4];
  dequant_word_fields(word, fields);
  return static_cast<std::uint16_t>(num::bf16x2_mul(fields[slot.reg], pair) >> (16 * slot.half));
}

// ---- scales ----

// The table holds each scale code's value times 2^(126 - fold) as a BF16 pair; the masked value
// (times 2^-126) times that is the weight times 2^-fold, exact, and the kernel multiplies its
// sums by 2^fold. NVFP4 folds 7: every E4M3 scale (at most 448) then stays below BF16's largest
// power of two. MXFP4 folds from the largest E8M0 code present (ops/decode_pack.h).
inline constexpr int kNvfp4Fold = 7;

}  // namespace metrale::decode_layout
