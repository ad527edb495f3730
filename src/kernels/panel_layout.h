// The panel layout: NVFP4, MXFP4 and INT4 weights rearranged at upload (ops/panel_pack.h) for the
// CPU kernels with AVX-512 BF16, so that one 64-byte load decodes into four vectors of BF16
// pairs, 16 columns each, with no transpose (see Note [CPU panel layout] in docs/NOTES.md). INT4
// weights move their codes only: their scales, zero points and permutation stay in the side
// buffer of kernels/int4_layout.h. The packer, the kernels and the tests share this definition.
#pragma once

#include <cstdint>

namespace metrale::panel_layout {

// What a kernel that reads this layout publishes as <entry>_layout (kernels/published.def); the
// decode layout is 1.
inline constexpr std::uint32_t kLayoutId = 2;

inline constexpr int kGroupCols = 16;  // columns (rows of W) per group: one vector's lanes
inline constexpr int kLineK = 8;       // K per 64-byte line of a group
inline constexpr int kLineBytes = 64;
// N is padded to whole pairs of groups (a tiled panel's 32 columns) with code 0 and scale code
// 0, which add exact zeros in both FP4 formats; INT4 pads with code 8 (weight 0 whatever the
// scale, and the kernels give padding columns scale 0).
inline constexpr int kPadCols = 2 * kGroupCols;

// INT4 weights take the layout when K is a multiple of this: their kernels scale a block's sum
// per 32, 64 or 128 K (the largest of them dividing the group), so every block lies in one group.
inline constexpr std::int64_t kInt4BlockK = 32;
inline constexpr std::uint8_t kInt4PadByte = 0x88;

inline std::int64_t padded_n(std::int64_t n) {
  return (n + kPadCols - 1) / kPadCols * kPadCols;
}
inline std::int64_t groups(std::int64_t n) {
  return padded_n(n) / kGroupCols;
}

// Bytes of the two buffers for W[N, K] (K a multiple of the format's group, so of 16).
inline std::int64_t code_bytes(std::int64_t n, std::int64_t k) {
  return padded_n(n) * k / 2;
}
inline std::int64_t scale_bytes(std::int64_t n, std::int64_t k, int group) {
  return padded_n(n) * (k / group);
}

// Line t of group g (K 8t..8t+7 of columns 16g..16g+15) starts at this byte of the codes. A
// group's lines are consecutive, so one group streams as one run of K / 2 * 16 bytes.
inline std::int64_t line_offset(std::int64_t k, std::int64_t g, std::int64_t t) {
  return (g * (k / kLineK) + t) * kLineBytes;
}

// Within a line, 16-bit word j = 2c + h holds column c's codes for k = 8t + 2s + h at bits
// 4s..4s+3 (s = 0..3). Shifting the line's words right by 4s and looking the low 4 bits up as
// BF16 gives vector s: dword c is the pair (k = 8t + 2s, 8t + 2s + 1) of column c, the even k
// low, as vdpbf16ps pairs them.
inline int word_of(int c, int h) {
  return 2 * c + h;
}
inline int nibble_shift(int s) {
  return 4 * s;
}

// The scale codes of group g for block b (group of K) are 16 consecutive bytes, one per column.
inline std::int64_t scale_offset(std::int64_t k, int group, std::int64_t g, std::int64_t b) {
  return (g * (k / group) + b) * kGroupCols;
}

// W[n, k]'s code, from the packed codes (n < padded_n).
inline std::uint8_t code_at(const std::uint8_t* codes, std::int64_t k, std::int64_t n,
                            std::int64_t kk) {
  const std::int64_t g = n / kGroupCols, c = n % kGroupCols, t = kk / kLineK;
  const int s = static_cast<int>(kk % kLineK) / 2, h = static_cast<int>(kk % 2);
  const std::uint8_t* word = codes + line_offset(k, g, t) + 2 * word_of(static_cast<int>(c), h);
  const unsigned v = static_cast<unsigned>(word[0]) | static_cast<unsigned>(word[1]) << 8;
  return static_cast<std::uint8_t>((v >> nibble_shift(s)) & 0xF);
}

// W[n, block b]'s scale code, from the packed scales.
inline std::uint8_t scale_at(const std::uint8_t* scales, std::int64_t k, int group, std::int64_t n,
                             std::int64_t b) {
  return scales[scale_offset(k, group, n / kGroupCols, b) + n % kGroupCols];
}

}  // namespace metrale::panel_layout
