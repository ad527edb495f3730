// The repack of NVFP4 and MXFP4 host weights into the decode layout (kernels/decode_layout.h)
// that gemm_decode_packed reads, run once per upload, and read-backs of the packed buffers for
// the tests and the CPU twin.
//
// The codes buffer holds the E2M1 codes tile by tile, each 32-bit word the 8 codes one lane
// dequantizes into one A fragment. The scales buffer is a table of 256 BF16 pairs (entry c:
// scale(c) x 2^(126 - fold), twice) and then the scale codes at decode_layout::scale_byte. The
// kernel masks a code into a BF16 pair (value x 2^-126), multiplies it by its table pair (one
// HMUL2: the weight x 2^-fold) and scales each sum by 2^fold. Padding (N to 32, K to 128) holds
// code 0 and scale code 0, so it adds exact zeros.
//
// How the scales are treated:
//  - NVFP4 (E4M3 per 16 K): fold 7. Every E4M3 code's entry is exact in BF16 (its largest, 448,
//    becomes 1.75 x 2^127; its subnormals 2^-9 .. 7 x 2^-9 stay normal), and so is every
//    product with an E2M1 value: each packed weight equals e2m1 x scale exactly. The NaN codes
//    0x7F and 0xFF have NaN entries, so their weights are NaN, as in the reference.
//  - MXFP4 (E8M0 per 32 K): fold = (largest code present, 255 aside) - 128 (0 when no code is
//    finite; it may be negative), so the largest code's entry is 2^127 and code c's is
//    2^(c - largest + 127). A weight is exact when its code lies at most 133 binades below the
//    largest (c >= largest - 133: the product e2m1 x 2^(c - largest + 1) is then a multiple of
//    BF16's smallest subnormal, 2^-133); further below, the 2^-fold product rounds to nearest
//    even in BF16's subnormal range and flushes to 0 at the bottom. Code 255 is NaN (NaN entry),
//    code 0 is 2^-127 and 254 is 2^127, like e8m0_to_f32.
#pragma once

#include <cstdint>
#include <vector>

#include "metrale/quant.h"

namespace metrale::ops {

// Weights in the decode layout, with the shape and format they were packed from.
struct PackedDecodeWeights {
  WeightFormat format = WeightFormat::kNvfp4;
  std::int64_t n = 0, k = 0;         // the source's shape (unpadded)
  std::vector<std::uint8_t> codes;   // decode_layout::code_bytes(n, k) bytes
  std::vector<std::uint8_t> scales;  // the table, then the scale codes: scale_bytes(n, k, mx)
  std::int32_t fold = 0;             // GemmParams::weight_fold: the kernel's sums x 2^fold
  float tensor_scale = 1.0f;         // the source's tensor scale, unchanged (not folded)
};

// w (either format, either layout) in the decode layout. Throws Error(kInvalidArgument,
// "pack_for_decode") naming the bad value for a bad shape or buffer size.
PackedDecodeWeights pack_for_decode(const HostQuantWeights& w);

// The E2M1 code of W[n, k] as stored in p.codes; n < padded_n(p.n) and k < padded_k(p.k), so
// the padding can be read too. Throws Error(kInvalidArgument) outside that.
std::uint8_t packed_code(const PackedDecodeWeights& p, std::int64_t n, std::int64_t k);

// The scale code of W[n, k]'s group as stored in p.scales (same range as packed_code).
std::uint8_t packed_scale_code(const PackedDecodeWeights& p, std::int64_t n, std::int64_t k);

// W[n, k] as the kernel computes it, tensor scale not included: the BF16 product of the word's
// field pair (decode_layout::dequant_word_fields) and the table pair, times 2^fold in float.
float packed_weight(const PackedDecodeWeights& p, std::int64_t n, std::int64_t k);

}  // namespace metrale::ops
