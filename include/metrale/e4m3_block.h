// Block-scaled E4M3 on the host: the operands of the W8A8 GEMM and of FP8 checkpoints
// (DeepSeek-V3 / Qwen layout, metrale/fp8_checkpoint.h).
//  - Weights W[N, K]: E4M3 codes [N, K] row-major and one FP32 scale per 128 x 128 block, stored
//    [ceil(N/128), ceil(K/128)] row-major; W[n, k] = e4m3(code) x scale of its block. The last
//    block of a row or column of blocks may be partial.
//  - Activations A[M, K]: E4M3 codes [M, K] row-major and one FP32 scale per row per 128 K,
//    stored [ceil(K/128), M] (M fastest, so a 128-K step reads one contiguous column of scales).
// Every scale is amax / 448 of its block, rounded to the nearest FP32, so that the block's
// largest magnitude lands on E4M3's largest finite value; an all-zero block gets scale 1 (codes
// 0), which keeps every scale positive and finite, so 1 / scale never divides by zero.
//
// Memory: 1 byte per weight plus 4 bytes per 128 x 128 block (4 / 16384 bytes a weight), about
// 1.78 x NVFP4's 0.5625 bytes a weight. requantize_e4m3_block128 (NVFP4 or MXFP4 weights into
// this form, the W8A8 route's opt-in at upload) costs that in place of the 4-bit weights.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "metrale/quant.h"

namespace metrale {

// Rows and columns of weights one scale covers, and K of activations one scale covers.
inline constexpr std::int64_t kE4m3Block = 128;

// Number of 128-blocks covering `extent` elements: ceil(extent / 128); 0 for extent <= 0.
std::int64_t e4m3_blocks(std::int64_t extent) noexcept;

// Block-scaled E4M3 weights [N, K] viewed in memory someone else owns (a mapped checkpoint, or
// a HostE4m3BlockWeights).
struct E4m3BlockWeightsView {
  std::int64_t n = 0, k = 0;
  std::span<const std::uint8_t> codes;  // N * K E4M3 codes, row-major [N, K]
  std::span<const float> scales;        // e4m3_blocks(N) * e4m3_blocks(K), row-major

  // The scale of the block holding W[row, col]. Throws Error(kInvalidArgument) outside the
  // matrix or when the spans do not match n and k.
  float scale(std::int64_t row, std::int64_t col) const;
  // W[row, col] = e4m3(code) x scale, in float64 (exact: a 4-bit times a 24-bit significand).
  double weight(std::int64_t row, std::int64_t col) const;
};

// Block-scaled E4M3 weights [N, K] that own their codes and scales.
struct HostE4m3BlockWeights {
  std::int64_t n = 0, k = 0;
  std::vector<std::uint8_t> codes;  // N * K, row-major [N, K]
  std::vector<float> scales;        // e4m3_blocks(N) * e4m3_blocks(K), row-major

  // A view of this object's data (valid while it lives and is not resized).
  E4m3BlockWeightsView view() const noexcept { return {n, k, codes, scales}; }
};

// Quantizes FP32 W[n, k] (row-major) into caller-sized outputs: codes (n * k bytes) and scales
// (e4m3_blocks(n) * e4m3_blocks(k) floats). Each block's scale is amax / 448 rounded to FP32
// (1 for an all-zero block, and never below the smallest positive float), each code the
// correctly rounded E4M3 of w / scale (nearest, ties to even, saturating at ±448; -0 stays
// 0x80). Nothing is written unless every check passes: n, k > 0, the sizes, every w finite;
// otherwise Error(kInvalidArgument) naming the call and the bad value.
void quantize_e4m3_block128(std::span<const float> w, std::int64_t n, std::int64_t k,
                            std::span<std::uint8_t> codes, std::span<float> scales);
// quantize_e4m3_block128 into a new HostE4m3BlockWeights.
HostE4m3BlockWeights quantize_e4m3_block128(std::span<const float> w, std::int64_t n,
                                            std::int64_t k);
// The same from BF16 bit patterns W[n, k] (exact widening to FP32 first).
HostE4m3BlockWeights quantize_e4m3_block128_bf16(std::span<const std::uint16_t> w, std::int64_t n,
                                                 std::int64_t k);
// NVFP4 or MXFP4 weights (either layout) into block-scaled E4M3: each weight is dequantized
// exactly in float64 (e2m1 x block scale x tensor scale, never rounded to FP32 first), then
// quantized as quantize_e4m3_block128 does. Memory: see the header comment. Throws
// Error(kInvalidArgument) for inconsistent weights or a weight that is not finite (a NaN block
// scale, a non-finite tensor scale). threads: how many host threads share the 128-row blocks
// (1: the caller's alone); the result does not depend on it.
HostE4m3BlockWeights requantize_e4m3_block128(const HostQuantWeights& w, int threads = 1);
// Dequantized W [n, k] row-major, each e4m3(code) x scale rounded once to FP32.
std::vector<float> dequantize(const E4m3BlockWeightsView& w);

// Block-scaled E4M3 activations A[M, K] that own their codes and scales.
struct HostE4m3Activations {
  std::int64_t m = 0, k = 0;
  std::vector<std::uint8_t> codes;  // M * K, row-major [M, K]
  std::vector<float> scales;        // e4m3_blocks(K) * M, stored [ceil(K/128), M], M fastest
};

// The activation cast's reference: BF16 A[m, k] (row-major bit patterns) into caller-sized
// outputs, codes (m * k bytes, [M, K]) and scales (e4m3_blocks(k) * m floats, [ceil(K/128), M]).
// A row's 128-K block gets scale amax / 448 in FP32 (1 when all zero); each code is
// f32_to_e4m3(a / scale) with the quotient an IEEE FP32 division (round to nearest even), what
// a device does with div.rn.f32 and a saturating E4M3 conversion, so a cast kernel can match it
// bit for bit. Nothing is written unless every check passes: m, k > 0, the sizes, every a finite;
// otherwise Error(kInvalidArgument) naming the call and the bad value.
void quantize_e4m3_activations(std::span<const std::uint16_t> a, std::int64_t m, std::int64_t k,
                               std::span<std::uint8_t> codes, std::span<float> scales);
// quantize_e4m3_activations into a new HostE4m3Activations.
HostE4m3Activations quantize_e4m3_activations(std::span<const std::uint16_t> a, std::int64_t m,
                                              std::int64_t k);

}  // namespace metrale
