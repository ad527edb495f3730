// Module "core" on the GPU: the element-wise kernels whose host twins live in
// src/cpu/modules/core_module.cpp. Each publishes the output tile one block covers, which the
// launcher reads at lookup to size its grid, and the block size it is written for, which the
// launcher reads rather than assume one. Device code only: includes nothing from host code
// but the verification macro (kernels/verified_devices.h, constants only).
#include <cstdint>

#include "kernels/verified_devices.h"
#include "metrale/numerics.h"

namespace {
constexpr unsigned kThreads = 256;
constexpr unsigned kFillTile = kThreads;      // one element per thread
constexpr unsigned kAxpyTile = kThreads * 4;  // four elements per thread
constexpr unsigned kCastTile = kThreads * 4;  // four elements per thread
}  // namespace

extern "C" {

// Published metadata (read with cuModuleGetGlobal); externally visible, so never dropped.
__device__ std::uint32_t fill_u32_n_tile = kFillTile;
__device__ std::uint32_t axpy_f32_n_tile = kAxpyTile;
__device__ std::uint32_t cast_f32_bf16_n_tile = kCastTile;
__device__ std::uint32_t fill_u32_block_threads = kThreads;
__device__ std::uint32_t axpy_f32_block_threads = kThreads;
__device__ std::uint32_t cast_f32_bf16_block_threads = kThreads;

// Run 6 of 2026-12-04 on an H200 (docs/GPU.md) ran these entries' sm_90a code against the CPU
// backend (Gpu.ElementwiseOpsMatchTheCpuBackend) and in the NCCL test; no other target's code has
// run on a GPU.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
METRALE_VERIFIED(fill_u32, H200, 20261204);
METRALE_VERIFIED(axpy_f32, H200, 20261204);
METRALE_VERIFIED(cast_f32_bf16, H200, 20261204);
#endif

// out[i] = value over this block's tile of kFillTile elements.
__global__ void __launch_bounds__(kThreads)
    fill_u32(std::uint32_t* out, std::uint32_t value, std::uint32_t n) {
  const std::uint64_t i = std::uint64_t{blockIdx.x} * kFillTile + threadIdx.x;
  if (i < n) out[i] = value;
}

// y[i] = a * x[i] + y[i] over this block's tile of kAxpyTile elements (strided by the block
// size so neighbouring threads touch neighbouring words).
__global__ void __launch_bounds__(kThreads)
    axpy_f32(float* y, const float* x, float a, std::uint32_t n) {
  const std::uint64_t base = std::uint64_t{blockIdx.x} * kAxpyTile + threadIdx.x;
#pragma unroll
  for (unsigned j = 0; j < kAxpyTile / kThreads; ++j) {
    const std::uint64_t i = base + std::uint64_t{j} * kThreads;
    if (i < n) y[i] = fmaf(a, x[i], y[i]);
  }
}

// out[i] = in[i] rounded to BF16 (nearest even, as metrale::num::f32_to_bf16 on the host) over
// this block's tile of kCastTile elements: a row-parallel layer's one rounding of its FP32 sum.
__global__ void __launch_bounds__(kThreads)
    cast_f32_bf16(std::uint16_t* out, const float* in, std::uint32_t n) {
  const std::uint64_t base = std::uint64_t{blockIdx.x} * kCastTile + threadIdx.x;
#pragma unroll
  for (unsigned j = 0; j < kCastTile / kThreads; ++j) {
    const std::uint64_t i = base + std::uint64_t{j} * kThreads;
    if (i < n) out[i] = metrale::num::f32_to_bf16(in[i]);
  }
}

}  // extern "C"
