// Thin wrappers over the PTX the w4a16 kernels use: read-only 16-byte loads, cp.async, the
// m16n8k16 BF16 MMA (sm_80+), and on sm_90a the wgmma family (BF16 and E4M3) with its fences.
// Device code only; each wrapper is one instruction or one fixed sequence. A host build that runs
// kernel code (METRALE_KERNEL_HOST_EMULATION, tests/kernels/emulation) takes its own definitions
// of the wrappers from kernel_host_ptx.h instead.
#pragma once

#include <cstdint>

#if defined(METRALE_KERNEL_HOST_EMULATION)
#include "kernel_host_ptx.h"
#else

namespace metrale::ptx {

// 16 bytes through the read-only (non-coherent) path; the kernels never write what they read.
__device__ __forceinline__ uint4 ldg16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 8 bytes through the read-only path.
__device__ __forceinline__ uint2 ldg8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// 16 bytes to global memory in one store (p 16-byte aligned).
__device__ __forceinline__ void stg16(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Plain shared-memory accesses at a shared address (the producer's and consumers' staged words).
__device__ __forceinline__ void st_shared16(std::uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared4(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared2(std::uint32_t addr, std::uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared16(std::uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ std::uint32_t ld_shared4(std::uint32_t addr) {
  std::uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// A table lookup: ld.shared.u32 like ld_shared4, named apart because its address is data (a
// scale code), so the host emulation leaves it out of its bank-conflict check.
__device__ __forceinline__ std::uint32_t ld_shared_lookup(std::uint32_t addr) {
  std::uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint2 ld_shared8(std::uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

// Copies 16 bytes global → shared without registers; src_bytes < 16 zero-fills the rest (0 for
// a row or K chunk outside the matrix).
__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The 64-bit product w · kC as its two 32-bit halves: one IMAD.WIDE.U32, on the FMA pipe.
template <std::uint32_t kC>
__device__ __forceinline__ void mul_wide_u32(std::uint32_t w, std::uint32_t& lo,
                                             std::uint32_t& hi) {
  asm("{\n\t.reg .u64 t;\n\tmul.wide.u32 t, %2, %3;\n\tmov.b64 {%0, %1}, t;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(w), "n"(kC));
}

// (x & kMask) | kOr as one LOP3: written as C, ptxas splits it into two (a LOP3 takes one
// immediate), so the PTX names both constants and ptxas keeps one in a register.
template <std::uint32_t kMask, std::uint32_t kOr>
__device__ __forceinline__ std::uint32_t and_or(std::uint32_t x) {
  std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(kMask), "n"(kOr));
  return r;
}

// The bytes of (kB : x) that `select` picks (prmt.b32, default mode): selector nibble i names the
// source byte of result byte i, 0-3 from x and 4-7 from the constant kB. A selector known after
// unrolling becomes the instruction's immediate.
template <std::uint32_t kB>
__device__ __forceinline__ std::uint32_t prmt(std::uint32_t x, std::uint32_t select) {
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "n"(kB), "r"(select));
  return r;
}

// The bytes of (b : a) that kSelect picks (prmt.b32, default mode): selector nibble i names the
// source byte of result byte i, 0-3 from a and 4-7 from b.
template <std::uint32_t kSelect>
__device__ __forceinline__ std::uint32_t prmt2(std::uint32_t a, std::uint32_t b) {
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "n"(kSelect));
  return r;
}

// D += A · B for one m16n8k16 tile: A row-major BF16 (4 registers), B column-major BF16
// (2 registers), D FP32 (4 registers).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                               std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Ties x to this point of the program (it emits nothing): work that uses x cannot be hoisted
// above the volatile asm (a load, an MMA) that precedes it, which bounds how many steps of an
// unrolled loop the compiler keeps live at once.
__device__ __forceinline__ void pin(std::uint32_t& x) {
  asm volatile("" : "+r"(x));
}
__device__ __forceinline__ void pin64(std::uint64_t& x) {
  asm volatile("" : "+l"(x));
}

// bar.sync on named barrier kId (1..15; 0 is __syncthreads') for `count` threads (a multiple of
// 32): a barrier for one warpgroup without holding the others.
template <int kId>
__device__ __forceinline__ void named_barrier_sync(int count) {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "r"(count) : "memory");
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define METRALE_HAVE_WGMMA 1

// setmaxnreg: this warpgroup's registers per thread become kCount (a multiple of 8, 24..256);
// .inc waits until the SM's pool has them, .dec returns them to it.
template <int kCount>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kCount) : "memory");
}
template <int kCount>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kCount) : "memory");
}

// Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible to the
// async proxy that wgmma reads through; issued before the barrier that publishes a stage.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across an in-flight wgmma.
__device__ __forceinline__ void fence_regs(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}

#define METRALE_ACC8(i)                                                                           \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])

// D (64x256 FP32 per warpgroup) = A · B (+ D when accumulate): BF16 operands in shared memory,
// both K-major, 16 K.
__device__ __forceinline__ void wgmma_bf16_m64n256k16(float (&d)[128], std::uint64_t desc_a,
                                                      std::uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127}, "
      "%128, %129, p, 1, 1, 0, 0;\n}\n"
      : METRALE_ACC8(0), METRALE_ACC8(8), METRALE_ACC8(16), METRALE_ACC8(24), METRALE_ACC8(32),
        METRALE_ACC8(40), METRALE_ACC8(48), METRALE_ACC8(56), METRALE_ACC8(64), METRALE_ACC8(72),
        METRALE_ACC8(80), METRALE_ACC8(88), METRALE_ACC8(96), METRALE_ACC8(104), METRALE_ACC8(112),
        METRALE_ACC8(120)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D (64x64 FP32 per warpgroup) = A · B (+ D when accumulate): E4M3 operands in shared memory,
// both K-major, 32 K.
__device__ __forceinline__ void wgmma_e4m3_m64n64k32(float (&d)[32], std::uint64_t desc_a,
                                                     std::uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : METRALE_ACC8(0), METRALE_ACC8(8), METRALE_ACC8(16), METRALE_ACC8(24)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D (64x128 FP32 per warpgroup) = A · B (+ D when accumulate): E4M3 operands in shared memory,
// both K-major, 32 K (the m64n64k32 form above with twice the columns).
__device__ __forceinline__ void wgmma_e4m3_m64n128k32(float (&d)[64], std::uint64_t desc_a,
                                                      std::uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : METRALE_ACC8(0), METRALE_ACC8(8), METRALE_ACC8(16), METRALE_ACC8(24), METRALE_ACC8(32),
        METRALE_ACC8(40), METRALE_ACC8(48), METRALE_ACC8(56)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D (64x128 FP32 per warpgroup) += A · B with A from registers (the RS form): this thread's
// four BF16-pair registers of A (for warp w of the warpgroup, rows 16w..16w+15 as mma.m16n8k16's
// A fragment; PTX ISA 9.7.15.5.1.1.1, Matrix Fragments for wgmma.mma_async.m64nNk16) and B
// K-major in shared memory (no transpose), 16 K.
__device__ __forceinline__ void wgmma_bf16_m64n128k16_rs(float (&d)[64],
                                                         const std::uint32_t (&a)[4],
                                                         std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : METRALE_ACC8(0), METRALE_ACC8(8), METRALE_ACC8(16), METRALE_ACC8(24), METRALE_ACC8(32),
        METRALE_ACC8(40), METRALE_ACC8(48), METRALE_ACC8(56)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

#undef METRALE_ACC8
// ---- mbarriers and bulk copies (sm_90), for the warp-specialized pipeline ----

__device__ __forceinline__ void mbarrier_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the async proxy (the bulk copies' complete_tx).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Announces `bytes` more bytes that bulk copies will complete on the barrier's current phase.
__device__ __forceinline__ void mbarrier_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// This thread's arrival (release: its earlier shared-memory writes are visible to the waiters).
__device__ __forceinline__ void mbarrier_arrive(std::uint32_t bar) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}" ::"r"(bar)
      : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void mbarrier_wait(std::uint32_t bar, std::uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// The TMA unit's bulk copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from global
// to shared memory, completing its bytes on barrier `bar`.
__device__ __forceinline__ void bulk_copy_g2s(std::uint32_t dst, const void* src,
                                              std::uint32_t bytes, std::uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

#endif  // sm_90a

}  // namespace metrale::ptx

#endif  // METRALE_KERNEL_HOST_EMULATION
