// The PTX wrappers of src/cuda/kernels/ptx.cuh that the emulated kernels use, on the host
// (cuda_host.h, sm90_host.h): the same names and signatures, plain C++ behind them. ptx.cuh
// includes this instead of its asm when METRALE_KERNEL_HOST_EMULATION is defined. The emulation
// is an sm_90a device: METRALE_HAVE_WGMMA is defined, as ptx.cuh defines it there.
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

// st.global.v4.u32: 16 bytes, which must be 16-byte aligned (a fault where not).
inline void stg16(void* p, uint4 v) {
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) {
    emulation::fault("ptx::stg16: a misaligned store");
    return;
  }
  std::memcpy(p, &v, 16);
}

// mul.wide.u32: the 64-bit product's halves.
template <std::uint32_t kC>
inline void mul_wide_u32(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  const std::uint64_t t = std::uint64_t{w} * kC;
  lo = static_cast<std::uint32_t>(t);
  hi = static_cast<std::uint32_t>(t >> 32);
}

// lop3 (a & b) | c.
template <std::uint32_t kMask, std::uint32_t kOr>
inline std::uint32_t and_or(std::uint32_t x) {
  return (x & kMask) | kOr;
}

// prmt.b32 (default mode): result byte i is byte (select >> 4 i) & 7 of {b : a}.
inline std::uint32_t prmt_bytes(std::uint32_t a, std::uint32_t b, std::uint32_t select) {
  const std::uint64_t both = (std::uint64_t{b} << 32) | a;
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned src = (select >> (4 * i)) & 7u;
    r |= static_cast<std::uint32_t>((both >> (8 * src)) & 0xFFu) << (8 * i);
  }
  return r;
}
template <std::uint32_t kSelect>
inline std::uint32_t prmt2(std::uint32_t a, std::uint32_t b) {
  return prmt_bytes(a, b, kSelect);
}
template <std::uint32_t kB>
inline std::uint32_t prmt(std::uint32_t x, std::uint32_t select) {
  return prmt_bytes(x, kB, select);
}

// The warp-collective m16n8k16 BF16 MMA (cuda_host.h).
inline void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                           std::uint32_t b1) {
  emulation::warp_mma(d, a, b0, b1);
}

// Orders nothing on the host.
inline void pin(std::uint32_t&) {}
inline void pin64(std::uint64_t&) {}
inline void fence_regs(float&) {}

// ---- shared memory (sm90_host.h's arena; every access but a table lookup bank-checked) ----

inline std::uint32_t smem_addr(const void* p) {
  return emulation::shared_address(p);
}
template <class T>
inline void st_shared(std::uint32_t addr, const T& v, const char* what) {
  emulation::record_shared(addr, sizeof(T), what);
  emulation::note_generic_write(addr, sizeof(T));
  if (unsigned char* at = emulation::shared_at(addr, sizeof(T), sizeof(T), what)) {
    std::memcpy(at, &v, sizeof(T));
  }
}
template <class T>
inline T ld_shared(std::uint32_t addr, const char* what, bool record = true) {
  if (record) emulation::record_shared(addr, sizeof(T), what);
  T v{};
  if (const unsigned char* at = emulation::shared_at(addr, sizeof(T), sizeof(T), what)) {
    std::memcpy(&v, at, sizeof(T));
  }
  return v;
}
inline void st_shared16(std::uint32_t addr, uint4 v) {
  st_shared(addr, v, "st.shared.v4");
}
inline void st_shared4(std::uint32_t addr, std::uint32_t v) {
  st_shared(addr, v, "st.shared.u32");
}
inline void st_shared2(std::uint32_t addr, std::uint16_t v) {
  st_shared(addr, v, "st.shared.u16");
}
inline uint4 ld_shared16(std::uint32_t addr) {
  return ld_shared<uint4>(addr, "ld.shared.v4");
}
inline uint2 ld_shared8(std::uint32_t addr) {
  return ld_shared<uint2>(addr, "ld.shared.v2");
}
inline std::uint32_t ld_shared4(std::uint32_t addr) {
  return ld_shared<std::uint32_t>(addr, "ld.shared.u32");
}
inline std::uint32_t ld_shared_lookup(std::uint32_t addr) {
  return ld_shared<std::uint32_t>(addr, "ld.shared.u32 (lookup)", false);
}

// ---- the sm_90 pipeline (sm90_host.h) ----

#define METRALE_HAVE_WGMMA 1

// Shared memory's generic writes so far, ordered before the async proxy's reads (wgmma).
inline void fence_proxy_async() {
  emulation::fence_proxy_async();
}
inline void fence_mbarrier_init() {}
inline void mbarrier_init(std::uint32_t bar, std::uint32_t count) {
  emulation::mbarrier_init(bar, count);
}
inline void mbarrier_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  emulation::mbarrier_expect_tx(bar, bytes);
}
inline void mbarrier_arrive(std::uint32_t bar) {
  emulation::mbarrier_arrive(bar);
}
inline void mbarrier_wait(std::uint32_t bar, std::uint32_t parity) {
  emulation::mbarrier_wait(bar, parity);
}
// The source is checked as a load (readable, 16-byte aligned) when the copy starts.
inline void bulk_copy_g2s(std::uint32_t dst, const void* src, std::uint32_t bytes,
                          std::uint32_t bar) {
  if (emulation::check_load(src, bytes, 16, "cp.async.bulk")) {
    emulation::bulk_copy(dst, src, bytes, bar);
  }
}
inline void cp_async16(std::uint32_t dst, const void* src, int src_bytes) {
  if (src_bytes == 0 || emulation::check_load(src, 16, 16, "cp.async")) {
    emulation::cp_async(dst, src, src_bytes);
  }
}
inline void cp_async_commit() {
  emulation::cp_async_commit();
}
template <int N>
inline void cp_async_wait() {
  emulation::cp_async_wait(N);
}
inline void wgmma_fence() {
  emulation::wgmma_fence();
}
inline void wgmma_commit() {
  emulation::wgmma_commit();
}
template <int N>
inline void wgmma_wait() {
  emulation::wgmma_wait(N);
}
inline void wgmma_bf16_m64n128k16_rs(float (&d)[64], const std::uint32_t (&a)[4],
                                     std::uint64_t desc_b) {
  emulation::wgmma_rs_m64n128k16(d, a, desc_b);
}
inline void wgmma_e4m3_m64n128k32(float (&d)[64], std::uint64_t desc_a, std::uint64_t desc_b,
                                  int accumulate) {
  emulation::wgmma_ss_e4m3_m64n128k32(d, desc_a, desc_b, accumulate != 0);
}
template <int kId>
inline void named_barrier_sync(int count) {
  emulation::named_barrier(kId, count);
}
// The host has no register file to share out.
template <int kCount>
inline void setmaxnreg_inc() {}
template <int kCount>
inline void setmaxnreg_dec() {}

}  // namespace metrale::ptx
