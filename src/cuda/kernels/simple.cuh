// The correctness-first GEMM of the w4a16 module: one warp per output column, the block scales
// applied per K-group in FP32. The tiled and E4M3 routes use it on GPUs without wgmma (sm_80,
// sm_89), where those routes have no tuned kernel yet; dequant_e4m3 uses code_at.
#pragma once

#include <cstdint>

#include "epilogue.cuh"
#include "kernels/gemm_params.h"
#include "metrale/numerics.h"

namespace metrale::kernels::simple {

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;
constexpr int kRowsPerPass = 16;  // rows of A each warp keeps in registers

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
  write_final(p, m * p.n + n, n, sum);
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

// The block's share: warp w of block b takes column b·kWarps + w.
template <bool E4M3>
__device__ void block(const GemmParams& p) {
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n < p.n) column<E4M3>(p, n, threadIdx.x % 32);
}

}  // namespace metrale::kernels::simple
