// The argument block of the w4a16 module's GEMM kernels, passed by value as one kernel
// parameter on every backend. Plain data only, so CUDA kernels include it too.
#pragma once

#include <cstdint>

namespace metrale {

// Bits of GemmParams::flags.
enum GemmFlags : std::uint32_t {
  kGemmMxfp4 = 1u << 0,       // E8M0 scales per 32 k (else NVFP4: E4M3 scales per 16 k)
  kGemmTransposed = 1u << 1,  // codes [K/2, N], scales [K/group, N] (else [N, K/2], [N, K/group])
  kGemmBias = 1u << 2,        // add BF16 bias[N]
  // codes and scales in the decode layout (kernels/decode_layout.h; gemm_decode_packed only)
  kGemmDecodePacked = 1u << 3,
  // C [M, N] as FP32: the sum after tensor scale and bias, not rounded (kernels that publish
  // out_f32 only)
  kGemmOutF32 = 1u << 4,
  // Codes and scales in the panel layout (kernels/panel_layout.h): the CPU kernels of modules
  // that publish it as <entry>_layout only.
  kGemmPanels = 1u << 5,
  // INT4 weights (Note [INT4 weights]): codes [N, K/2] unsigned, `scales` the side buffer of
  // kernels/int4_layout.h, `group` K per scale. Only kernels that publish <entry>_int4 read them.
  kGemmInt4 = 1u << 6,
  kGemmFp16Scales = 1u << 7,  // INT4: the scales are FP16 (else BF16)
  kGemmZeroPoints = 1u << 8,  // INT4: zero points follow the scales (else every zero point is 8)
  kGemmActOrder = 1u << 9,    // INT4: A's columns are read through the stored K permutation
};

struct GemmParams {
  std::uint64_t a = 0;       // A [M, K]: BF16 (E4M3 for gemm_e4m3)
  std::uint64_t codes = 0;   // packed E2M1 codes (E4M3 bytes [N, K] for gemm_e4m3)
  std::uint64_t scales = 0;  // block scales, layout per flags
  std::uint64_t out = 0;     // C [M, N] BF16 (FP32 with kGemmOutF32)
  std::uint64_t bias = 0;    // BF16 [N] when kGemmBias
  std::int64_t m = 0, n = 0, k = 0;
  float tensor_scale = 1.0f;
  std::uint32_t flags = 0;
  // kGemmDecodePacked: the weights are stored times 2^-weight_fold (decode_layout.h); the kernel
  // multiplies each sum by 2^weight_fold before tensor_scale.
  std::int32_t weight_fold = 0;
  // Split-K (kernels that publish <entry>_split_k): grid z has `splits` slices of k_per_split
  // K each, which write FP32 partials [splits, M, N] to `workspace` for gemm_split_reduce.
  // splits = 1: no split, workspace unused, the kernel writes C itself.
  std::uint64_t workspace = 0;
  std::int64_t splits = 1;
  std::int64_t k_per_split = 0;
  std::int64_t group = 0;  // kGemmInt4: K elements per scale
  // kGemmActOrder: A's columns, which k_perm indexes (K, or fewer for a padded K slice: its -1
  // entries read 0; metrale/quant.h, k_perm). 0: K.
  std::int64_t a_k = 0;
};

// Arguments of bf16_to_fp8 (docs/CONTRACT.md, E4M3 cast) and dequant_e4m3.
struct CastParams {
  std::uint64_t in = 0;
  std::uint64_t out = 0;
  std::int64_t count = 0;   // elements (bf16_to_fp8) or rows N (dequant_e4m3)
  std::int64_t k = 0;       // dequant_e4m3: K
  std::uint32_t flags = 0;  // dequant_e4m3: kGemmTransposed
};

}  // namespace metrale
