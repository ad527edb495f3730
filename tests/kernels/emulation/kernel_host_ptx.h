// The PTX wrappers of src/cuda/kernels/ptx.cuh that the decode kernels use, on the host
// (cuda_host.h): the same names and signatures, plain C++ behind them. ptx.cuh includes this
// instead of its asm when METRALE_KERNEL_HOST_EMULATION is defined.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda_host.h"

namespace metrale::ptx {

// ld.global.nc.v4.u32: 16 aligned bytes (zeros and a fault outside the readable buffers).
inline uint4 ldg16(const void* p) {
  uint4 v{};
  if (emulation::check_load(p, 16, 16, "ptx::ldg16")) std::memcpy(&v, p, 16);
  return v;
}

// ld.global.nc.v2.u32: 8 aligned bytes (zeros and a fault outside the readable buffers).
inline uint2 ldg8(const void* p) {
  uint2 v{};
  if (emulation::check_load(p, 8, 8, "ptx::ldg8")) std::memcpy(&v, p, 8);
  return v;
}

// mul.wide.u32: the 64-bit product's halves.
template <std::uint32_t kC>
inline void mul_wide_u32(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  const std::uint64_t t = std::uint64_t{w} * kC;
  lo = static_cast<std::uint32_t>(t);
  hi = static_cast<std::uint32_t>(t >> 32);
}

// The warp-collective m16n8k16 BF16 MMA (cuda_host.h).
inline void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                           std::uint32_t b1) {
  emulation::warp_mma(d, a, b0, b1);
}

// Orders nothing on the host.
inline void pin(std::uint32_t&) {}

}  // namespace metrale::ptx
