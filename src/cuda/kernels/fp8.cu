// Module "fp8" on the GPU: the W8A8 op's activation cast (cast_e4m3_block128; the rules in
// src/kernels/fp8_cast.h, its host twin in src/cpu/kernels/fp8_cpu.cpp). A warp per (row, 128-K
// block) pair: each lane reads 4 BF16 of the block (strided by 32, so the warp's loads are
// coalesced), the warp reduces their largest magnitude, and each lane writes its 4 codes; lane 0
// writes the block's scale. Publishes the pairs one block covers (n_tile) and its block size.
#include <cstdint>

#include "kernels/fp8_cast.h"
#include "kernels/verified_devices.h"
#include "metrale/numerics.h"

namespace {

namespace f = metrale::fp8;
namespace num = metrale::num;

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;  // pairs per block
constexpr unsigned kPerLane = f::kCastBlock / 32;

}  // namespace

extern "C" {

__global__ void cast_e4m3_block128(metrale::Fp8CastParams p);

__device__ std::uint32_t cast_e4m3_block128_n_tile = kWarps;
__device__ std::uint32_t cast_e4m3_block128_block_threads = kThreads;

// Run 6 of 2026-12-04 on an H200 (docs/GPU.md) ran this entry's sm_90a code through the W8A8
// numerics suite and `metrale check`; no other target's code has run on a GPU.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
METRALE_VERIFIED(cast_e4m3_block128, H200, 20261204);
#endif

__global__ void __launch_bounds__(kThreads) cast_e4m3_block128(metrale::Fp8CastParams p) {
  const std::int64_t kblocks = (p.k + f::kCastBlock - 1) / f::kCastBlock;
  const std::int64_t pair = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (pair >= p.m * kblocks) return;  // whole warps leave together: the shuffles stay full
  const unsigned lane = threadIdx.x % 32;
  const std::int64_t m = pair / kblocks, kb = pair % kblocks;
  const std::int64_t k0 = kb * f::kCastBlock;
  const auto* in = reinterpret_cast<const std::uint16_t*>(p.in) + m * p.k;
  auto* codes = reinterpret_cast<std::uint8_t*>(p.codes) + m * p.k;
  float x[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (unsigned j = 0; j < kPerLane; ++j) {
    const std::int64_t q = k0 + lane + 32 * j;
    x[j] = q < p.k ? num::bf16_to_f32(in[q]) : 0.0f;
    amax = f::amax_step(amax, x[j]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    amax = f::amax_step(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  }
  const float s = f::block_scale(amax);
#pragma unroll
  for (unsigned j = 0; j < kPerLane; ++j) {
    const std::int64_t q = k0 + lane + 32 * j;
    if (q < p.k) codes[q] = f::encode(x[j], s);
  }
  if (lane == 0) reinterpret_cast<float*>(p.scales)[kb * f::scales_ld(p.m) + m] = s;
}

}  // extern "C"
