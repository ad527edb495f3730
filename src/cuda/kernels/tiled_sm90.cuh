// The prefill GEMM on Hopper tensor cores (wgmma, HGMMA in SASS), sm_90a only. A block computes
// a 128x256 tile of C with two warpgroups of 64 rows each (m64n256: the wide tile halves the
// shared-memory traffic of A per FLOP and spreads a stage's fixed costs over twice the MMAs). Per
// 64-K stage, A arrives by cp.async into a 128-byte-swizzled K-major tile; the weights' codes are
// loaded into registers while the previous stage multiplies, dequantized with the block scale
// folded into the BF16 value (exact) and stored into the same swizzled layout, so wgmma reads both
// operands straight from shared memory. Four stages, as CUTLASS's multistage wgmma mainloop: while
// stage k multiplies, the MMAs of k - 1 may still run, the weights of k + 1 (loaded during k - 1)
// are dequantized into shared memory, and the loads of k + 2 are in flight.
#pragma once

#include <cstdint>

#include "epilogue.cuh"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "operands.cuh"
#include "ptx.cuh"

namespace metrale::kernels {

#if defined(METRALE_HAVE_WGMMA)

// The codes (32, half a stage row) and raw scales (load_scales_raw) one thread dequantizes per
// stage; converted only when stored, an iteration after the loads.
struct TiledCodes {
  uint4 codes;
  std::uint32_t scales;
};

// The general (checked) load of a thread's 32 codes and their raw scales; the layout is a
// template parameter so the row-major loop carries none of the transposed path's byte gathers.
// Whole interior tiles take the unchecked loads in tiled_block_of instead.
template <bool kTr>
__device__ __forceinline__ void tiled_load_codes(TiledCodes& c, const GemmParams& p, std::int64_t n,
                                                 std::int64_t k0) {
  const int valid = valid_k(k0, p.k, 0);
  c.codes = load_codes<kTr>(p, n, k0, valid);
  c.scales = load_scales_raw<kTr>(p, n, k0, valid);
}

// 32 BF16 weights (4 chunks of 16 bytes) into row `row`, chunks 4 half .. 4 half + 3.
__device__ __forceinline__ void tiled_store_codes(const GemmParams& p, unsigned char* tile, int row,
                                                  int half, const TiledCodes& c,
                                                  const std::uint32_t* scale_pairs) {
  // The two scales as BF16 pairs from the block's table (fill_scale_pairs).
  const std::uint32_t pair[2] = {scale_pair_of_raw(p, scale_pairs, c.scales, 0),
                                 scale_pair_of_raw(p, scale_pairs, c.scales, 1)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const std::uint32_t w = word_of(c.codes, q);  // 8 codes; a group is 16
    uint4 v;
    dequant_quad(w & 0xFFFF, pair[q / 2], &v.x, &v.y);
    dequant_quad(w >> 16, pair[q / 2], &v.z, &v.w);
    const std::uint32_t at = tiles::swizzle128(static_cast<std::uint32_t>(row),
                                               static_cast<std::uint32_t>((4 * half + q) * 16));
    *reinterpret_cast<uint4*>(tile + at) = v;
  }
}

// cp.async of A's 128 x 64 stage tile: 1024 chunks of 8 BF16, 4 per thread; rows past M and K
// past the end are zero-filled. (Whole interior tiles take the unchecked loads in
// tiled_block_of.)
__device__ __forceinline__ void tiled_load_a(const GemmParams& p, std::uint32_t tile,
                                             std::int64_t m_block, std::int64_t k0) {
  const auto* a = reinterpret_cast<const std::uint16_t*>(p.a);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = threadIdx.x + tiles::kTiledThreads * i;
    const int row = c / 8, ch = c % 8;
    const std::int64_t m = m_block + row, k = k0 + 8 * ch;
    // K is a multiple of 16: a chunk is all in or all out.
    const bool in = m < p.m && k < p.k;
    ptx::cp_async16(tile + tiles::swizzle128(static_cast<std::uint32_t>(row),
                                             static_cast<std::uint32_t>(16 * ch)),
                    in ? a + m * p.k + k : a, in ? 16 : 0);
  }
}

template <bool kTr>
__device__ void tiled_block_of(const GemmParams& p, const std::uint32_t* scale_pairs) {
  namespace tl = metrale::tiles;
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzle is a function of the address: stages start on 1024-byte boundaries.
  const std::uint32_t raw = ptx::smem_addr(smem_raw);
  const std::uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  constexpr std::uint32_t kABytes = tl::kTiledMTile * 128u;
  const auto a_tile = [&](int s) { return base + s * tl::kTiledStageBytes; };
  const auto b_tile = [&](int s) { return smem + s * tl::kTiledStageBytes + kABytes; };
  const auto b_addr = [&](int s) { return base + s * tl::kTiledStageBytes + kABytes; };

  const int wg = threadIdx.x / 128, wtid = threadIdx.x % 128;
  const std::int64_t m_block = std::int64_t{blockIdx.y} * tl::kTiledMTile;
  const std::int64_t n_block = std::int64_t{blockIdx.x} * tl::kTiledNTile;
  // Each thread dequantizes kRuns runs of 32 codes a stage: run c = tid + 256 i is half c % 2 of
  // weight row c / 2, so neighbouring threads read neighbouring 16 bytes.
  constexpr int kRuns = tl::kTiledBRunsPerThread;
  int b_row[kRuns], b_half[kRuns];
#pragma unroll
  for (int i = 0; i < kRuns; ++i) {
    const int c = threadIdx.x + tl::kTiledThreads * i;
    b_row[i] = c / 2;
    b_half[i] = c % 2;
  }
  const std::int64_t k_tiles = (p.k + tl::kTiledKStage - 1) / tl::kTiledKStage;

  constexpr int kAcc = tl::kTiledNTile / 2;  // m64nN: N / 2 FP32 registers a thread
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

  // Stage s's loads: A by cp.async (one commit group per stage, empty past K so the group count
  // stays uniform), the codes into registers.
  // Whole tiles inside M, N and K take the unchecked loads (a block's flags are uniform).
  const bool k_whole = p.k % tl::kTiledKStage == 0;
  const bool a_inside = k_whole && m_block + tl::kTiledMTile <= p.m;
  const bool b_inside = k_whole && n_block + tl::kTiledNTile <= p.n;
  // The interior loads' addresses, computed once: each thread's 4 chunks of A (source row and
  // swizzled destination) and its row of codes and scales; a stage adds only its K offset.
  const bool mx = p.flags & kGemmMxfp4;
  const std::uint16_t* a_src[4];
  std::uint32_t a_dst[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = threadIdx.x + tl::kTiledThreads * i, row = c / 8, ch = c % 8;
    a_src[i] = reinterpret_cast<const std::uint16_t*>(p.a) + (m_block + row) * p.k + 8 * ch;
    a_dst[i] = tl::swizzle128(static_cast<std::uint32_t>(row), static_cast<std::uint32_t>(16 * ch));
  }
  const std::uint8_t* code_src[kRuns];
  const std::uint8_t* scale_src[kRuns];
#pragma unroll
  for (int i = 0; i < kRuns; ++i) {
    const std::int64_t n = n_block + b_row[i];
    code_src[i] = reinterpret_cast<const std::uint8_t*>(p.codes) + n * (p.k / 2) + 16 * b_half[i];
    scale_src[i] = reinterpret_cast<const std::uint8_t*>(p.scales) +
                   n * (mx ? p.k / 32 : p.k / 16) + (mx ? b_half[i] : 2 * b_half[i]);
  }
  const auto load = [&](std::int64_t kt, TiledCodes(&codes)[kRuns]) {
    if (kt < k_tiles) {
      const std::int64_t k0 = kt * tl::kTiledKStage;
      const std::uint32_t at = a_tile(static_cast<int>(kt % tl::kTiledStages));
      if (a_inside) {
#pragma unroll
        for (int i = 0; i < 4; ++i) ptx::cp_async16(at + a_dst[i], a_src[i] + k0, 16);
      } else {
        tiled_load_a(p, at, m_block, k0);
      }
#pragma unroll
      for (int i = 0; i < kRuns; ++i) {
        if (!kTr && b_inside) {
          codes[i].codes = ptx::ldg16(code_src[i] + k0 / 2);
          const std::uint8_t* sc = scale_src[i] + (mx ? k0 / 32 : k0 / 16);
          codes[i].scales = ldg_scales_raw(sc, mx);
        } else {
          tiled_load_codes<kTr>(codes[i], p, n_block + b_row[i], k0 + 32 * b_half[i]);
        }
      }
    }
    ptx::cp_async_commit();
  };
  const auto store = [&](std::int64_t kt, const TiledCodes(&codes)[kRuns]) {
    if (kt < k_tiles) {
#pragma unroll
      for (int i = 0; i < kRuns; ++i) {
        tiled_store_codes(p, b_tile(static_cast<int>(kt % tl::kTiledStages)), b_row[i], b_half[i],
                          codes[i], scale_pairs);
      }
    }
  };

  static_assert(tl::kTiledPrefetch == 2 && tl::kTiledStages >= tl::kTiledPrefetch + 2);
  // One iteration: multiply stage kt, store the weights of kt + 1 (`ready`, loaded during the
  // previous iteration) and start the loads of kt + 2 into `fill`.
  const auto step = [&](std::int64_t kt, const TiledCodes(&ready)[kRuns],
                        TiledCodes(&fill)[kRuns]) {
    // Stage kt's A has landed (one group, kt + 1's, may still be in flight) and its weights were
    // stored last iteration; the fence and barrier hand both to the async proxy.
    ptx::cp_async_wait<tl::kTiledPrefetch - 1>();
    ptx::fence_proxy_async();
    __syncthreads();
    // Safe to overwrite stage kt + 2 = kt - 2 (mod 4): every warpgroup waited for its MMAs of
    // kt - 2 before this barrier.
    load(kt + 2, fill);

    const int cs = static_cast<int>(kt % tl::kTiledStages);
    const std::uint32_t a_wg = a_tile(cs) + static_cast<std::uint32_t>(wg) * 64u * 128u;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_regs(acc[i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < tl::kTiledKStage / 16; ++kk) {
      // 16 K of BF16 is 32 bytes along the swizzled row.
      ptx::wgmma_bf16_m64n256k16(acc, tl::wgmma_desc_sw128(a_wg + 32u * kk),
                                 tl::wgmma_desc_sw128(b_addr(cs) + 32u * kk), 1);
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_regs(acc[i]);
    // Stage kt + 1's weights while the MMAs run; its buffer was last read by the MMAs of
    // kt - 3, long finished.
    store(kt + 1, ready);
    ptx::wgmma_wait<1>();  // the MMAs of kt - 1 are done; kt's may continue
  };

  // Two register sets trade roles every iteration (unrolled by two, so no copy waits on a load).
  TiledCodes even[kRuns], odd[kRuns];
  load(0, even);
  store(0, even);
  load(1, odd);
#pragma unroll 1
  for (std::int64_t kt = 0; kt < k_tiles; kt += 2) {
    step(kt, odd, even);  // stores kt + 1 (odd), loads kt + 2 into even
    if (kt + 1 < k_tiles) step(kt + 1, even, odd);
  }
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) ptx::fence_regs(acc[i]);

  store_wgmma_acc(p, acc, m_block + 64 * wg, n_block, wtid);
}

__device__ void tiled_block_sm90(const GemmParams& p) {
  static_assert(tiles::kTiledThreads == 256, "one scale code a thread");
  __shared__ std::uint32_t scale_pairs[256];
  fill_scale_pairs(p, scale_pairs);
  if (p.flags & kGemmTransposed) {
    tiled_block_of<true>(p, scale_pairs);
  } else {
    tiled_block_of<false>(p, scale_pairs);
  }
}

#endif  // METRALE_HAVE_WGMMA

}  // namespace metrale::kernels
