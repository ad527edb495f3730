// Module "w4a16" on the GPU, a first version written for correctness, not speed: one warp per
// output column for the GEMM routes, the block scales applied per K-group in FP32, the same
// per-element math as the CPU (numerics.h). It has NOT run on a GPU yet (docs/GPU.md); the
// Hopper kernels of issue 5 (16-byte loads, split-K, wgmma) replace it. Device code only.
#include <cstdint>

#include "metrale/gemm_params.h"
#include "metrale/numerics.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;
constexpr unsigned kCastPerThread = 16;
constexpr int kRowsPerPass = 16;  // rows of A each warp keeps in registers

using metrale::CastParams;
using metrale::GemmParams;
namespace num = metrale::num;

__device__ __forceinline__ std::uint8_t code_at(const std::uint8_t* codes, std::int64_t n_total,
                                                std::int64_t k_total, bool transposed,
                                                std::int64_t n, std::int64_t k) {
  const std::uint8_t byte =
      transposed ? codes[(k >> 1) * n_total + n] : codes[n * (k_total / 2) + (k >> 1)];
  return (k & 1) ? static_cast<std::uint8_t>(byte >> 4) : static_cast<std::uint8_t>(byte & 0xF);
}

__device__ __forceinline__ float scale_at(const GemmParams& p, std::int64_t n, std::int64_t g) {
  const bool mx = p.flags & metrale::kGemmMxfp4;
  const std::int64_t groups = p.k / (mx ? num::kMxfp4Group : num::kNvfp4Group);
  const auto* s = reinterpret_cast<const std::uint8_t*>(p.scales);
  const std::uint8_t v = (p.flags & metrale::kGemmTransposed) ? s[g * p.n + n] : s[n * groups + g];
  return mx ? num::e8m0_to_f32(v) : num::e4m3_to_f32(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ void store(const GemmParams& p, std::int64_t m, std::int64_t n,
                                      float sum) {
  float v = sum * p.tensor_scale;
  if (p.flags & metrale::kGemmBias) {
    v += num::bf16_to_f32(reinterpret_cast<const std::uint16_t*>(p.bias)[n]);
  }
  reinterpret_cast<std::uint16_t*>(p.out)[m * p.n + n] = num::f32_to_bf16(v);
}

// C[:, n] for the warp's column n. E4M3 selects the e4m3 route's operands: A as E4M3 bytes and
// the weights as E4M3 bytes [N, K]; otherwise A is BF16 and the weights packed E2M1.
template <bool E4M3>
__device__ void column(const GemmParams& p, std::int64_t n, unsigned lane) {
  const bool mx = p.flags & metrale::kGemmMxfp4;
  const bool transposed = p.flags & metrale::kGemmTransposed;
  const int group = mx ? num::kMxfp4Group : num::kNvfp4Group;
  const std::int64_t groups = p.k / group;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes);
  for (std::int64_t m0 = 0; m0 < p.m; m0 += kRowsPerPass) {
    const int rows = static_cast<int>(p.m - m0 < kRowsPerPass ? p.m - m0 : kRowsPerPass);
    float acc[kRowsPerPass];
#pragma unroll
    for (int i = 0; i < kRowsPerPass; ++i) acc[i] = 0.0f;
    for (std::int64_t g = lane; g < groups; g += 32) {
      float part[kRowsPerPass];
#pragma unroll
      for (int i = 0; i < kRowsPerPass; ++i) part[i] = 0.0f;
      for (int kk = 0; kk < group; ++kk) {
        const std::int64_t k = g * group + kk;
        const float w = E4M3 ? num::e4m3_to_f32(codes[n * p.k + k])
                             : num::e2m1_to_f32(code_at(codes, p.n, p.k, transposed, n, k));
#pragma unroll
        for (int i = 0; i < kRowsPerPass; ++i) {
          if (i < rows) {
            const std::int64_t at = (m0 + i) * p.k + k;
            const float a = E4M3
                                ? num::e4m3_to_f32(reinterpret_cast<const std::uint8_t*>(p.a)[at])
                                : num::bf16_to_f32(reinterpret_cast<const std::uint16_t*>(p.a)[at]);
            part[i] += w * a;
          }
        }
      }
      const float s = scale_at(p, n, g);
#pragma unroll
      for (int i = 0; i < kRowsPerPass; ++i) acc[i] += part[i] * s;
    }
#pragma unroll
    for (int i = 0; i < kRowsPerPass; ++i) {
      const float total = warp_sum(acc[i]);
      if (i < rows && lane == 0) store(p, m0 + i, n, total);
    }
  }
}

}  // namespace

extern "C" {

// Published metadata: what one block covers (read at lookup with cuModuleGetGlobal).
__device__ std::uint32_t bf16_to_fp8_n_tile = kThreads * kCastPerThread;  // elements
__device__ std::uint32_t dequant_e4m3_n_tile = kWarps;                    // weight rows
__device__ std::uint32_t gemm_decode_n_tile = kWarps;                     // output columns
__device__ std::uint32_t gemm_tiled_n_tile = kWarps;
__device__ std::uint32_t gemm_e4m3_n_tile = kWarps;

// The seed's cast: BF16 to E4M3, round to nearest even, saturating, no scale.
__global__ void __launch_bounds__(kThreads) bf16_to_fp8(CastParams p) {
  const auto* in = reinterpret_cast<const std::uint16_t*>(p.in);
  auto* out = reinterpret_cast<std::uint8_t*>(p.out);
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * kThreads * kCastPerThread;
#pragma unroll
  for (unsigned j = 0; j < kCastPerThread; ++j) {
    const std::int64_t i = base + j * kThreads + threadIdx.x;
    if (i < p.count) out[i] = num::bf16_to_e4m3(in[i]);
  }
}

// Rows of packed E2M1 codes as E4M3 bytes [N, K] (every E2M1 value is exact in E4M3).
__global__ void __launch_bounds__(kThreads) dequant_e4m3(CastParams p) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= p.count) return;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.in);
  auto* out = reinterpret_cast<std::uint8_t*>(p.out);
  const bool transposed = p.flags & metrale::kGemmTransposed;
  for (std::int64_t k = threadIdx.x % 32; k < p.k; k += 32) {
    out[row * p.k + k] =
        num::f32_to_e4m3(num::e2m1_to_f32(code_at(codes, p.count, p.k, transposed, row, k)));
  }
}

__global__ void __launch_bounds__(kThreads) gemm_decode(GemmParams p) {
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n < p.n) column<false>(p, n, threadIdx.x % 32);
}

__global__ void __launch_bounds__(kThreads) gemm_tiled(GemmParams p) {
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n < p.n) column<false>(p, n, threadIdx.x % 32);
}

__global__ void __launch_bounds__(kThreads) gemm_e4m3(GemmParams p) {
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n < p.n) column<true>(p, n, threadIdx.x % 32);
}

}  // extern "C"
