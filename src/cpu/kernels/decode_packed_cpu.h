// The CPU twin of the CUDA kernel gemm_decode_packed: the same GEMM over weights in the decode
// layout (kernels/decode_layout.h, packed by ops/decode_pack.h), each weight dequantized as the
// kernel does (the word's field pair times its scale's table pair, one BF16 rounding).
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"

namespace metrale::cpu::w4a16 {

// C[:, n0:n1] = BF16(sum_k A[m, k] x w(n, k) x 2^weight_fold x tensor_scale (+ bias[n])), with
// p.codes and p.scales in the decode layout (kb_count from p.k, MXFP4 when kGemmMxfp4) and w the
// BF16 weight x 2^-weight_fold of decode_layout::dequant_word_fields and the table; FP32 sums.
// Split-K fields are ignored: it writes C itself, like the other CPU twins.
void gemm_decode_packed(const GemmParams& p, std::int64_t n0, std::int64_t n1);

}  // namespace metrale::cpu::w4a16
