// The E4M3 route's GEMM on Hopper FP8 tensor cores (wgmma E4M3, QGMMA in SASS), sm_90a only:
// C = Σ_groups (A · Wᵀ over the group) × scale[n, group], in FP32, times the tensor scale.
// A and W are E4M3 bytes [M, K] and [N, K] (bf16_to_fp8 and dequant_e4m3 wrote them); the block
// scales stay out of the FP8 values because E4M3 cannot hold a scaled E2M1 value exactly. An
// FP8 MMA sums 32 K, a scale group is 16: each group's 16 bytes sit in a 32-byte slot whose
// upper half is zero, so one MMA sums exactly one group into a fresh FP32 tile (a stage's four
// are issued together), which is scaled per column and added to the accumulator. That costs half
// the FP8 rate; it is what exact per-16 scales on an FP8 MMA cost.
#pragma once

#include <cstdint>

#include "epilogue.cuh"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "operands.cuh"
#include "ptx.cuh"

namespace metrale::kernels {

#if defined(METRALE_HAVE_WGMMA)

__device__ void e4m3_block_sm90(const GemmParams& p) {
  namespace tl = metrale::tiles;
  constexpr int kGroups = tl::kE4m3GroupsPerStage;
  constexpr std::uint32_t kABytes = tl::kE4m3MTile * tl::kE4m3RowBytes;
  constexpr std::uint32_t kBBytes = tl::kE4m3NTile * tl::kE4m3RowBytes;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t raw = ptx::smem_addr(smem_raw);
  const std::uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const auto a_addr = [&](int s) { return base + s * tl::kE4m3StageBytes; };
  const auto b_addr = [&](int s) { return base + s * tl::kE4m3StageBytes + kABytes; };
  const auto scales = [&](int s) {
    return reinterpret_cast<float*>(smem + s * tl::kE4m3StageBytes + kABytes + kBBytes);
  };

  // The zero upper halves of every slot (A's 128 rows, then B's 64: one swizzled row index
  // across both, since 128 is a multiple of the 8-row atom) are written once here and never
  // again. Only the halves: no other thread ever writes these bytes, so no barrier is needed
  // before the prologue's loads; iteration 0's fence and barrier publish them to wgmma.
  for (int c = threadIdx.x; c < tl::kE4m3Stages * (tl::kE4m3MTile + tl::kE4m3NTile) * kGroups;
       c += tl::kE4m3Threads) {
    const int per_stage = (tl::kE4m3MTile + tl::kE4m3NTile) * kGroups;
    const int stage = c / per_stage, row = (c % per_stage) / kGroups, q = c % kGroups;
    *reinterpret_cast<uint4*>(
        smem + stage * tl::kE4m3StageBytes +
        tl::swizzle128(static_cast<std::uint32_t>(row), static_cast<std::uint32_t>(32 * q + 16))) =
        make_uint4(0, 0, 0, 0);
  }

  const int wg = threadIdx.x / 128, wtid = threadIdx.x % 128;
  const std::int64_t m_block = std::int64_t{blockIdx.y} * tl::kE4m3MTile;
  const std::int64_t n_block = std::int64_t{blockIdx.x} * tl::kE4m3NTile;
  const std::int64_t k_stage = std::int64_t{kGroups} * tl::kE4m3Group;
  const std::int64_t k_tiles = (p.k + k_stage - 1) / k_stage;
  const auto* a_e4m3 = reinterpret_cast<const std::uint8_t*>(p.a);
  const auto* w_e4m3 = reinterpret_cast<const std::uint8_t*>(p.codes);
  const int group_div = (p.flags & kGemmMxfp4) ? 2 : 1;  // scale groups of 16 K per block scale

  // One stage: A's 128 x 4 group chunks (2 a thread), W's 64 x 4 (1 a thread), and the 64 x 4
  // scales as FP32 (1 a thread). Chunks past M, N or K are zero, their scales 0.
  // Returns the thread's raw scale code for the stage (0 outside N and K: a finite scale of an
  // all-zero tile); store_scale writes it as FP32 once the MMAs are issued, so nothing waits on
  // that load before them.
  const auto load_stage = [&](int s, std::int64_t kt) -> std::uint32_t {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = threadIdx.x + tl::kE4m3Threads * i;
      const int row = c / kGroups, q = c % kGroups;
      const std::int64_t m = m_block + row, k = kt * k_stage + q * tl::kE4m3Group;
      const bool in = m < p.m && k < p.k;
      ptx::cp_async16(a_addr(s) + tl::swizzle128(static_cast<std::uint32_t>(row),
                                                 static_cast<std::uint32_t>(32 * q)),
                      in ? a_e4m3 + m * p.k + k : a_e4m3, in ? 16 : 0);
    }
    const int row = threadIdx.x / kGroups, q = threadIdx.x % kGroups;
    const std::int64_t n = n_block + row, k = kt * k_stage + q * tl::kE4m3Group;
    const bool in = n < p.n && k < p.k;
    ptx::cp_async16(b_addr(s) + tl::swizzle128(static_cast<std::uint32_t>(row),
                                               static_cast<std::uint32_t>(32 * q)),
                    in ? w_e4m3 + n * p.k + k : w_e4m3, in ? 16 : 0);
    std::uint32_t raw = 0;
    if (in)
      raw = reinterpret_cast<const std::uint8_t*>(
          p.scales)[scale_index(p, n, (k / tl::kE4m3Group) / group_div)];
    return raw;
  };
  const auto store_scale = [&](int s, std::uint32_t raw) {
    const auto v = static_cast<std::uint8_t>(raw);
    scales(s)[threadIdx.x] = (p.flags & kGemmMxfp4) ? num::e8m0_to_f32(v) : num::e4m3_to_f32(v);
  };

  // The accumulator, and one fresh tile per group of the stage: the stage's four MMAs are issued
  // together and waited for once.
  float acc[32], part[kGroups][32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    acc[i] = 0.0f;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) part[q][i] = 0.0f;
  }

#pragma unroll
  for (int s = 0; s < tl::kE4m3Stages - 1; ++s) {
    if (s < k_tiles) store_scale(s, load_stage(s, s));
    ptx::cp_async_commit();
  }

#pragma unroll 1
  for (std::int64_t kt = 0; kt < k_tiles; ++kt) {
    ptx::cp_async_wait<tl::kE4m3Stages - 2>();
    ptx::fence_proxy_async();
    __syncthreads();

    const std::int64_t next = kt + tl::kE4m3Stages - 1;
    const int ns = static_cast<int>(next % tl::kE4m3Stages);
    std::uint32_t next_scale = 0;
    if (next < k_tiles) next_scale = load_stage(ns, next);
    ptx::cp_async_commit();

    const int cs = static_cast<int>(kt % tl::kE4m3Stages);
    const std::uint32_t a_wg =
        a_addr(cs) + static_cast<std::uint32_t>(wg) * 64u * tl::kE4m3RowBytes;
    const float* sc = scales(cs);
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
#pragma unroll
      for (int i = 0; i < 32; ++i) ptx::fence_regs(part[q][i]);
    }
    ptx::wgmma_fence();
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      ptx::wgmma_e4m3_m64n64k32(part[q], tl::wgmma_desc_sw128(a_wg + 32u * q),
                                tl::wgmma_desc_sw128(b_addr(cs) + 32u * q), 0);
    }
    ptx::wgmma_commit();
    // Stage next's scales: its buffer was last read before this iteration's barrier.
    if (next < k_tiles) store_scale(ns, next_scale);
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        ptx::fence_regs(part[q][i]);
        acc[i] += part[q][i] * sc[tl::wgmma_acc_col(wtid, i) * kGroups + q];
      }
    }
  }

  store_wgmma_acc(p, acc, m_block + 64 * wg, n_block, wtid);
}

#endif  // METRALE_HAVE_WGMMA

}  // namespace metrale::kernels
