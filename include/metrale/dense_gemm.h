// Dense GEMMs a backend runs from its own GEMM library: cuBLASLt on CUDA (loaded at run time),
// reference kernels on the CPU. The quantized ops build routes on them (dequantize → BF16 GEMM,
// W8A8 block-scaled FP8); the shapes and layouts below are the whole contract between an op and
// a backend's library (docs/CONTRACT.md, dense GEMMs).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "metrale/handles.h"

namespace metrale {

// What A and B hold. Every kind writes C[M, N] row-major: BF16 rounded once from FP32, or the
// FP32 value itself where the shape asks for it (DenseGemmShape::out_f32).
enum class DenseKind {
  // A [M, K] and B [N, K] BF16, row-major; exact BF16 products, FP32 accumulation.
  kBf16,
  // A [M, K] and B [N, K] E4M3, row-major; exact E4M3 products summed in FP32 per 128-K block,
  // each block's sum multiplied by a_scales[kb * lda + m] (one FP32 per row per 128 K, stored
  // K-block-major: [ceil(K/128), lda], lda = dense_a_scales_ld(M) = round_up(M, 4)) and
  // b_scales[(n / 128) * ldb + kb] (one FP32 per 128 x 128 block of B, row-major
  // [ceil(N/128), ldb], ldb = dense_b_scales_ld(K) = round_up(ceil(K/128), 4)), then summed over
  // blocks in FP32. The padded leading dimensions are cuBLASLt's layouts (the CUDA backend runs
  // M padded to a multiple of 4, whose zero rows read a_scales' padding); the padding entries
  // (m >= M, kb >= ceil(K/128)) may hold anything and never reach C. A backend may refuse an N
  // or K its library excludes (CUDA: K % 16, N % 8, or N % 4 with FP32 C; docs/CONTRACT.md).
  kE4m3Block128,
};
// "bf16", "e4m3-block128".
std::string_view to_string(DenseKind kind) noexcept;

// The block edge of kE4m3Block128's scales.
inline constexpr std::int64_t kDenseScaleBlock = 128;
// The multiple kE4m3Block128's scale leading dimensions are rounded up to.
inline constexpr std::int64_t kDenseScaleLdMultiple = 4;

// ceil(v / 128): the 128-blocks of a dimension of v elements (0 <= v <= INT64_MAX - 127).
constexpr std::int64_t dense_scale_blocks(std::int64_t v) noexcept {
  return (v + kDenseScaleBlock - 1) / kDenseScaleBlock;
}
// lda of kE4m3Block128's a_scales for M rows: round_up(M, 4) (0 <= M <= INT64_MAX - 3).
constexpr std::int64_t dense_a_scales_ld(std::int64_t m) noexcept {
  return (m + kDenseScaleLdMultiple - 1) / kDenseScaleLdMultiple * kDenseScaleLdMultiple;
}
// ldb of kE4m3Block128's b_scales for K columns: round_up(ceil(K/128), 4) (0 <= K <= INT64_MAX -
// 127).
constexpr std::int64_t dense_b_scales_ld(std::int64_t k) noexcept {
  return dense_a_scales_ld(dense_scale_blocks(k));
}

// One GEMM shape: C[M, N] = A[M, K] · B[N, K]ᵀ (+ bias[N], BF16, added in FP32 before rounding;
// every kind and output type takes the same BF16 bias).
struct DenseGemmShape {
  DenseKind kind = DenseKind::kBf16;
  std::int64_t m = 0, n = 0, k = 0;
  bool bias = false;
  bool out_f32 = false;  // C is FP32 (the sum and bias, not rounded): row-parallel partials
  friend bool operator==(const DenseGemmShape&, const DenseGemmShape&) = default;
};

// What a backend decided for one shape, made by Backend::plan_dense_gemm. The backend memoizes
// the decision per shape (the library's heuristic is asked once); the plan is plain data, valid
// on the backend that made it until its OpCache is released.
struct DenseGemmPlan {
  DenseGemmShape shape;
  std::uint64_t workspace_bytes = 0;  // scratch run_dense_gemm needs, padding included (0: none)
  std::uint64_t algorithm = 0;        // the backend's key for its memoized choice
  std::string describe;  // e.g. "cuBLASLt BF16 algo 66 tile 128x256" or "cpu reference"
};

// The buffers of one run. A, B, C and the scales 16-byte aligned; C overlaps no input.
struct DenseGemmArgs {
  DevicePtr a, b, c;
  DevicePtr bias;                // BF16 [N] when the shape has one
  DevicePtr a_scales, b_scales;  // kE4m3Block128 only
  DevicePtr workspace;           // at least the plan's workspace_bytes, the backend's own memory
  std::uint64_t workspace_bytes = 0;
};

// Bytes of A, B, C and the two scale tensors of shape (0 for a part the kind does not have).
struct DenseGemmBytes {
  std::uint64_t a = 0, b = 0, c = 0, bias = 0, a_scales = 0, b_scales = 0;
};
// The sizes of shape's buffers; Error(kInvalidArgument) naming api when a dimension is below 1
// or a size does not fit 64 bits.
DenseGemmBytes dense_gemm_bytes(std::string_view api, const DenseGemmShape& shape);

}  // namespace metrale
