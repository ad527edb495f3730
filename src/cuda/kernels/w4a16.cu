// Module "w4a16" on the GPU (its entries: kernels/w4a16.def): the BF16 → E4M3 cast, the E4M3
// and BF16 dequantizations of the weights, and the GEMM routes. Decode (small M) runs on mma.sync
// tensor cores on every target; the tiled and E4M3 routes run on wgmma on sm_90a (tiled_sm90.cuh,
// e4m3_sm90.cuh) and on the correctness-first warp-per-column kernel elsewhere (simple.cuh). Each
// entry publishes the launch shape its code uses, per target: <entry>_n_tile (grid x), _m_tile
// (grid y; 0 = one block row covers all of M), _smem_bytes (dynamic shared memory), _split_k (K per
// split-K unit; 0 = no split), _block_threads, _blocks_per_sm (the blocks an SM holds, as the
// kernel's __launch_bounds__ says: the wave of a split-K or persistent grid), _persistent (the
// kernel loops over its tiles), _a_e4m3, _out_f32, and gemm_decode_max_m (the largest M the
// automatic route sends to decode). The op code sizes every launch from these alone.
// <entry>_verified(_on) (kernels/verified_devices.h) says which device run verified an entry; the
// automatic route and the preferred upload layout choose only those.
#include <cstdint>

#include "decode.cuh"
#include "decode_int4.cuh"
#include "decode_packed.cuh"
#include "dequant_bf16.cuh"
#include "e4m3_sm90.cuh"
#include "fused_sm90.cuh"
#include "grouped.cuh"
#include "kernels/dequant_int4.h"
#include "kernels/fused_tile.h"
#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/int4_permute.h"
#include "kernels/tile_math.h"
#include "kernels/verified_devices.h"
#include "metrale/numerics.h"
#include "ptx.cuh"
#include "simple.cuh"
#include "split_reduce.cuh"
#include "tiled_sm90.cuh"

namespace {

namespace tl = metrale::tiles;
namespace num = metrale::num;
namespace k = metrale::kernels;
using metrale::CastParams;
using metrale::GemmParams;
using metrale::GroupedGemmParams;

constexpr unsigned kThreads = 256;
constexpr unsigned kCastPerThread = 16;       // two 16-byte loads of BF16
constexpr unsigned kDequantRowsPerBlock = 8;  // a warp per row
constexpr unsigned kReducePerBlock = kThreads;
// The blocks per SM each GEMM kernel is compiled for: the second argument of its
// __launch_bounds__ (gemm_decode's implied 1) and its published <entry>_blocks_per_sm. One each:
// the decode kernels hold 209-255 registers a thread (their 8 warps fill the register file), and
// the sm_90a wgmma kernels most of the registers or shared memory (tests/offline/fatbin_test.cpp
// checks that every target's cubin really fits this many). The casts, dequantizations and the
// split-K reduction are flat launches over their element counts that no occupancy sizes: they
// publish none.
constexpr unsigned kDecodeBlocksPerSm = 1, kDecodePackedBlocksPerSm = 1, kTiledBlocksPerSm = 1,
                   kE4m3BlocksPerSm = 1, kFusedBlocksPerSm = 1, kDecodeInt4BlocksPerSm = 1;

#if defined(METRALE_HAVE_WGMMA)
constexpr std::uint32_t kTiledN = tl::kTiledNTile, kTiledM = tl::kTiledMTile,
                        kTiledSmem = tl::kTiledSmemBytes;
constexpr std::uint32_t kE4m3N = tl::kE4m3NTile, kE4m3M = tl::kE4m3MTile,
                        kE4m3Smem = tl::kE4m3SmemBytes;
// gemm_fused: tiles of 128 weight rows x 128 tokens, looped over by each block (fused_tiles'
// order); it publishes _persistent, so ops/gemm.cpp launches one wave of min(tiles, SMs x
// kFusedBlocksPerSm) blocks rather than a block per tile.
constexpr std::uint32_t kFusedN = metrale::fused::kRows, kFusedM = metrale::fused::kTokens,
                        kFusedSmem = metrale::fused::kSmemBytes,
                        kFusedThreads = metrale::fused::kThreads;
#else
constexpr std::uint32_t kTiledN = k::simple::kWarps, kTiledM = 0, kTiledSmem = 0;
constexpr std::uint32_t kE4m3N = k::simple::kWarps, kE4m3M = 0, kE4m3Smem = 0;
// Without wgmma there is no fused kernel: the entry is a placeholder that publishes
// gemm_fused_absent and nothing of a launch shape, so no route chooses it and a request for it is
// refused (ops/gemm.cpp). Looping the decode kernel over M in rounds of 16 would read every weight
// ceil(M / 16) times, slower than the tiled route on the source layout.
constexpr std::uint32_t kFusedThreads = 32;
#endif

}  // namespace

extern "C" {

// Every manifest entry, declared with the argument block the manifest gives it: a definition
// below that takes another one does not compile.
#define METRALE_W4A16_ENTRY(entry, Params, route) __global__ void entry(metrale::Params);
#include "kernels/w4a16.def"
#undef METRALE_W4A16_ENTRY

// Published metadata (read at lookup with cuModuleGetGlobal; checked offline against the code by
// tests/offline/fatbin_test.cpp).
__device__ std::uint32_t bf16_to_fp8_n_tile = kThreads * kCastPerThread;  // elements
__device__ std::uint32_t dequant_e4m3_n_tile = kDequantRowsPerBlock;      // weight rows
__device__ std::uint32_t dequant_bf16_n_tile = kThreads;  // units of 32 weights (dequant_bf16.h)
__device__ std::uint32_t gemm_split_reduce_n_tile = kReducePerBlock;  // outputs of M x N
__device__ std::uint32_t gemm_decode_n_tile = tl::kDecodeNTile;
__device__ std::uint32_t gemm_decode_split_k = tl::kDecodeSplitUnit;
__device__ std::uint32_t gemm_decode_a_e4m3 = 0;
__device__ std::uint32_t gemm_decode_packed_n_tile = metrale::decode_layout::kTileN;
__device__ std::uint32_t gemm_decode_packed_split_k = tl::kDecodeSplitUnit;
__device__ std::uint32_t gemm_decode_packed_a_e4m3 = 0;
__device__ std::uint32_t gemm_decode_packed_block_threads = tl::kDecodeThreads;
__device__ std::uint32_t gemm_decode_packed_layout = metrale::decode_layout::kLayoutId;
__device__ std::uint32_t gemm_decode_packed_max_m = tl::kDecodeMaxM;
__device__ std::uint32_t gemm_tiled_n_tile = kTiledN;
__device__ std::uint32_t gemm_tiled_m_tile = kTiledM;
__device__ std::uint32_t gemm_tiled_smem_bytes = kTiledSmem;
__device__ std::uint32_t gemm_tiled_a_e4m3 = 0;
__device__ std::uint32_t gemm_e4m3_n_tile = kE4m3N;
__device__ std::uint32_t gemm_e4m3_m_tile = kE4m3M;
__device__ std::uint32_t gemm_e4m3_smem_bytes = kE4m3Smem;
__device__ std::uint32_t gemm_e4m3_a_e4m3 = 1;
// No gemm_e4m3_min_m: the automatic route never takes this kernel on CUDA. On an H200 it ran at
// 0.14-0.16x cuBLASLt BF16 at M = 4096, slower than the exact tiled route on every shape
// (docs/GPU.md, run 5), so allowing E4M3 activations must not make a GEMM slower.
#if defined(METRALE_HAVE_WGMMA)
__device__ std::uint32_t gemm_fused_n_tile = kFusedN;
__device__ std::uint32_t gemm_fused_m_tile = kFusedM;
__device__ std::uint32_t gemm_fused_smem_bytes = kFusedSmem;
__device__ std::uint32_t gemm_fused_block_threads = kFusedThreads;
__device__ std::uint32_t gemm_fused_layout = metrale::decode_layout::kLayoutId;
__device__ std::uint32_t gemm_fused_a_e4m3 = 0;
__device__ std::uint32_t gemm_fused_out_f32 = 1;
__device__ std::uint32_t gemm_fused_persistent = 1;
__device__ std::uint32_t gemm_fused_blocks_per_sm = kFusedBlocksPerSm;
#else
__device__ std::uint32_t gemm_fused_absent = 1;
#endif
__device__ std::uint32_t gemm_decode_max_m = tl::kDecodeMaxM;
// Every kernel that writes C writes it through epilogue.cuh's write_final, which honours
// kGemmOutF32 (FP32 C, the row-parallel partials).
__device__ std::uint32_t gemm_decode_out_f32 = 1;
__device__ std::uint32_t gemm_decode_packed_out_f32 = 1;
__device__ std::uint32_t gemm_split_reduce_out_f32 = 1;
__device__ std::uint32_t gemm_tiled_out_f32 = 1;
__device__ std::uint32_t gemm_e4m3_out_f32 = 1;
__device__ std::uint32_t bf16_to_fp8_block_threads = kThreads;
__device__ std::uint32_t dequant_e4m3_block_threads = kThreads;
__device__ std::uint32_t dequant_bf16_block_threads = kThreads;
__device__ std::uint32_t dequant_bf16_min_m = tl::kDequantMinM;
__device__ std::uint32_t gemm_split_reduce_block_threads = kThreads;
__device__ std::uint32_t gemm_decode_block_threads = tl::kDecodeThreads;
__device__ std::uint32_t gemm_tiled_block_threads = kThreads;
__device__ std::uint32_t gemm_e4m3_block_threads = kThreads;
__device__ std::uint32_t gemm_decode_blocks_per_sm = kDecodeBlocksPerSm;
__device__ std::uint32_t gemm_decode_packed_blocks_per_sm = kDecodePackedBlocksPerSm;
__device__ std::uint32_t gemm_tiled_blocks_per_sm = kTiledBlocksPerSm;
__device__ std::uint32_t gemm_e4m3_blocks_per_sm = kE4m3BlocksPerSm;

// INT4 in the INT4 decode layout (kernels/int4_decode_layout.h): the decode kernel, with
// gemm_decode_packed's grid, split-K and largest M, and the dequant route's dequantization, a
// thread per unit of 8 weights, and act order's gather of A. None has run on a device: no
// METRALE_VERIFIED line, so they run only for weights a caller uploads in that layout
// (UploadLayout::kDecode), never by preference.
__device__ std::uint32_t gemm_int4_decode_n_tile = metrale::decode_layout::kTileN;
__device__ std::uint32_t gemm_int4_decode_split_k = tl::kDecodeSplitUnit;
__device__ std::uint32_t gemm_int4_decode_block_threads = tl::kDecodeThreads;
__device__ std::uint32_t gemm_int4_decode_blocks_per_sm = kDecodeInt4BlocksPerSm;
__device__ std::uint32_t gemm_int4_decode_layout = metrale::int4_decode::kLayoutId;
__device__ std::uint32_t gemm_int4_decode_max_m = tl::kDecodeMaxM;
__device__ std::uint32_t gemm_int4_decode_a_e4m3 = 0;
__device__ std::uint32_t gemm_int4_decode_out_f32 = 1;
__device__ std::uint32_t gemm_int4_decode_int4 = 1;
__device__ std::uint32_t dequant_int4_bf16_n_tile = kThreads;  // units of 8 weights
__device__ std::uint32_t dequant_int4_bf16_block_threads = kThreads;
__device__ std::uint32_t dequant_int4_bf16_layout = metrale::int4_decode::kLayoutId;
__device__ std::uint32_t dequant_int4_bf16_int4 = 1;
__device__ std::uint32_t permute_a_int4_n_tile = kThreads;  // units of 8 elements of A
__device__ std::uint32_t permute_a_int4_block_threads = kThreads;
__device__ std::uint32_t permute_a_int4_layout = metrale::int4_decode::kLayoutId;
__device__ std::uint32_t permute_a_int4_int4 = 1;

// The grouped GEMMs (kernels/grouped_params.h): grid y the expert, each block the decode kernel of
// its layout on its expert's rows and weights (M beyond 16 repeats the weights once per 16 rows,
// as the decode route does), splitting K as the decode route does (grid z; each expert's slices
// summed by gemm_grouped_split_reduce, a block per 256 columns of an expert's rows). None has run
// on a device: no METRALE_VERIFIED line, so ops/grouped_gemm.h runs them only for a caller that
// opts in.
__device__ std::uint32_t gemm_grouped_n_tile = tl::kDecodeNTile;
__device__ std::uint32_t gemm_grouped_block_threads = tl::kDecodeThreads;
__device__ std::uint32_t gemm_grouped_out_f32 = 1;
__device__ std::uint32_t gemm_grouped_split_k = tl::kDecodeSplitUnit;
__device__ std::uint32_t gemm_grouped_blocks_per_sm = kDecodeBlocksPerSm;
__device__ std::uint32_t gemm_grouped_packed_n_tile = metrale::decode_layout::kTileN;
__device__ std::uint32_t gemm_grouped_packed_block_threads = tl::kDecodeThreads;
__device__ std::uint32_t gemm_grouped_packed_layout = metrale::decode_layout::kLayoutId;
__device__ std::uint32_t gemm_grouped_packed_out_f32 = 1;
__device__ std::uint32_t gemm_grouped_packed_split_k = tl::kDecodeSplitUnit;
__device__ std::uint32_t gemm_grouped_packed_blocks_per_sm = kDecodePackedBlocksPerSm;
__device__ std::uint32_t gemm_grouped_int4_decode_n_tile = metrale::decode_layout::kTileN;
__device__ std::uint32_t gemm_grouped_int4_decode_block_threads = tl::kDecodeThreads;
__device__ std::uint32_t gemm_grouped_int4_decode_layout = metrale::int4_decode::kLayoutId;
__device__ std::uint32_t gemm_grouped_int4_decode_out_f32 = 1;
__device__ std::uint32_t gemm_grouped_int4_decode_split_k = tl::kDecodeSplitUnit;
__device__ std::uint32_t gemm_grouped_int4_decode_blocks_per_sm = kDecodeInt4BlocksPerSm;
__device__ std::uint32_t gemm_grouped_split_reduce_n_tile = kThreads;  // columns of an expert
__device__ std::uint32_t gemm_grouped_split_reduce_block_threads = kThreads;
__device__ std::uint32_t gemm_grouped_split_reduce_out_f32 = 1;
__device__ std::uint32_t gemm_grouped_int4_decode_int4 = 1;

// What a device run verified against the CPU reference: run 5 of 2026-11-29 on an H200
// (docs/GPU.md) ran the first six entries' sm_90a code, through the probe, the numerics suite on
// CUDA and `metrale check`; run 6 of 2026-12-04 the last three, the same way (dequant_bf16's
// numerics held to cuBLASLt's BF16 bias rounding where N % 8 != 0, toolkit/gemm_tolerance.h).
// No other target's code has run on a GPU.
// gemm_grouped_fused: gemm_fused's pipeline over the experts' tiles (fused_tile.h's slots), also
// persistent; its grid is a wave whatever the routing. None has run on a device either.
#if defined(METRALE_HAVE_WGMMA)
__device__ std::uint32_t gemm_grouped_fused_n_tile = kFusedN;
__device__ std::uint32_t gemm_grouped_fused_m_tile = kFusedM;
__device__ std::uint32_t gemm_grouped_fused_smem_bytes = metrale::fused::kGroupedSmemBytes;
__device__ std::uint32_t gemm_grouped_fused_block_threads = kFusedThreads;
__device__ std::uint32_t gemm_grouped_fused_layout = metrale::decode_layout::kLayoutId;
__device__ std::uint32_t gemm_grouped_fused_out_f32 = 1;
__device__ std::uint32_t gemm_grouped_fused_persistent = 1;
__device__ std::uint32_t gemm_grouped_fused_blocks_per_sm = kFusedBlocksPerSm;
#else
__device__ std::uint32_t gemm_grouped_fused_absent = 1;
#endif
// gemm_grouped_int4_fused: the same on INT4 experts in the INT4 decode layout (Note [grouped
// fused INT4]). None has run on a device either.
#if defined(METRALE_HAVE_WGMMA)
__device__ std::uint32_t gemm_grouped_int4_fused_n_tile = kFusedN;
__device__ std::uint32_t gemm_grouped_int4_fused_m_tile = kFusedM;
__device__ std::uint32_t gemm_grouped_int4_fused_smem_bytes = metrale::fused::kGroupedSmemBytes;
__device__ std::uint32_t gemm_grouped_int4_fused_block_threads = kFusedThreads;
__device__ std::uint32_t gemm_grouped_int4_fused_layout = metrale::int4_decode::kLayoutId;
__device__ std::uint32_t gemm_grouped_int4_fused_out_f32 = 1;
__device__ std::uint32_t gemm_grouped_int4_fused_int4 = 1;
__device__ std::uint32_t gemm_grouped_int4_fused_persistent = 1;
__device__ std::uint32_t gemm_grouped_int4_fused_blocks_per_sm = kFusedBlocksPerSm;
#else
__device__ std::uint32_t gemm_grouped_int4_fused_absent = 1;
#endif

#if defined(METRALE_HAVE_WGMMA)
METRALE_VERIFIED(bf16_to_fp8, H200, 20261129);
METRALE_VERIFIED(dequant_e4m3, H200, 20261129);
METRALE_VERIFIED(gemm_decode, H200, 20261129);
METRALE_VERIFIED(gemm_split_reduce, H200, 20261129);
METRALE_VERIFIED(gemm_tiled, H200, 20261129);
METRALE_VERIFIED(gemm_e4m3, H200, 20261129);
METRALE_VERIFIED(gemm_decode_packed, H200, 20261204);
METRALE_VERIFIED(gemm_fused, H200, 20261204);
METRALE_VERIFIED(dequant_bf16, H200, 20261204);
#endif

// The E4M3 cast (docs/CONTRACT.md, E4M3 cast): BF16 to E4M3, round to nearest even, saturating, no
// scale. Each thread reads 16 BF16 as two 16-byte loads and writes 16 bytes; the tail of a count
// that is not a multiple of 16 goes element by element. in and out are 16-byte aligned (the op
// checks).
__global__ void __launch_bounds__(kThreads) bf16_to_fp8(CastParams p) {
  const auto* in = reinterpret_cast<const std::uint16_t*>(p.in);
  auto* out = reinterpret_cast<std::uint8_t*>(p.out);
  const std::int64_t i0 =
      (static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kCastPerThread;
  if (i0 + kCastPerThread <= static_cast<std::uint64_t>(p.count)) {
    const uint4 lo = metrale::ptx::ldg16(in + i0), hi = metrale::ptx::ldg16(in + i0 + 8);
    const std::uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    std::uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const std::uint32_t a = w[2 * q], b = w[2 * q + 1];
      o[q] = std::uint32_t{num::bf16_to_e4m3(static_cast<std::uint16_t>(a & 0xFFFF))} |
             std::uint32_t{num::bf16_to_e4m3(static_cast<std::uint16_t>(a >> 16))} << 8 |
             std::uint32_t{num::bf16_to_e4m3(static_cast<std::uint16_t>(b & 0xFFFF))} << 16 |
             std::uint32_t{num::bf16_to_e4m3(static_cast<std::uint16_t>(b >> 16))} << 24;
    }
    *reinterpret_cast<uint4*>(out + i0) = make_uint4(o[0], o[1], o[2], o[3]);
    return;
  }
  for (std::int64_t i = i0; i < p.count && i < i0 + kCastPerThread; ++i) {
    out[i] = num::bf16_to_e4m3(in[i]);
  }
}

// Rows of packed E2M1 codes as E4M3 bytes [N, K] (every E2M1 value is exact in E4M3): a warp per
// row; each lane turns 8 code bytes into 16 E4M3 bytes (rows are K/2 bytes, a multiple of 8).
__global__ void __launch_bounds__(kThreads) dequant_e4m3(CastParams p) {
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * kDequantRowsPerBlock + threadIdx.x / 32;
  if (row >= p.count) return;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.in);
  auto* out = reinterpret_cast<std::uint8_t*>(p.out) + row * p.k;
  const unsigned lane = threadIdx.x % 32;
  if (p.flags & metrale::kGemmTransposed) {
    for (std::int64_t kk = lane; kk < p.k; kk += 32) {
      out[kk] = num::f32_to_e4m3(
          num::e2m1_to_f32(k::simple::code_at(codes, p.count, p.k, true, row, kk)));
    }
    return;
  }
  const std::uint8_t* src = codes + row * (p.k / 2);
  for (std::int64_t kk = 16 * lane; kk < p.k; kk += 16 * 32) {
    const uint2 v = metrale::ptx::ldg8(src + kk / 2);
    std::uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const std::uint32_t w = (q < 2 ? v.x : v.y) >> (16 * (q % 2));
      std::uint32_t r = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const auto c = static_cast<std::uint8_t>((w >> (4 * j)) & 0xF);
        r |= std::uint32_t{num::f32_to_e4m3(num::e2m1_to_f32(c))} << (8 * j);
      }
      o[q] = r;
    }
    *reinterpret_cast<uint4*>(out + kk) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// BF16 W [N, K] of the weights (codes, scales, tensor_scale, flags) into p.out: a thread per unit
// of 32 weights (dequant_bf16.cuh).
__global__ void __launch_bounds__(kThreads) dequant_bf16(GemmParams p) {
  k::dequant_bf16_unit(p, static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x);
}

// Bounds with no minimum, which means one block an SM (kDecodeBlocksPerSm): spelling the 1 out
// makes ptxas schedule the sm_90a code differently, and that code is what run 5 verified.
__global__ void __launch_bounds__(tl::kDecodeThreads) gemm_decode(GemmParams p) {
  k::decode_block(p);
}

__global__ void __launch_bounds__(tl::kDecodeThreads, kDecodePackedBlocksPerSm)
    gemm_decode_packed(GemmParams p) {
  k::decode_packed_block(p);
}

__global__ void __launch_bounds__(tl::kDecodeThreads, kDecodeInt4BlocksPerSm)
    gemm_int4_decode(GemmParams p) {
  k::decode_int4_block(p);
}

// BF16 W [N, K] of INT4 weights in the INT4 decode layout into p.out: a thread per unit of 8
// weights (kernels/dequant_int4.h).
__global__ void __launch_bounds__(kThreads) dequant_int4_bf16(GemmParams p) {
  metrale::dequant_int4::unit(p, static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x);
}

// A [M, K] gathered into the stored order of act-ordered INT4 weights into p.out: a thread per
// unit of 8 elements (kernels/int4_permute.h).
__global__ void __launch_bounds__(kThreads) permute_a_int4(GemmParams p) {
  metrale::int4_permute::unit(p, static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x);
}

__global__ void __launch_bounds__(kThreads) gemm_split_reduce(GemmParams p) {
  k::split_reduce(p, static_cast<std::int64_t>(blockIdx.x) * kReducePerBlock + threadIdx.x);
}

__global__ void __launch_bounds__(kThreads, kTiledBlocksPerSm) gemm_tiled(GemmParams p) {
#if defined(METRALE_HAVE_WGMMA)
  k::tiled_block_sm90(p);
#else
  k::simple::block<false>(p);
#endif
}

__global__ void __launch_bounds__(kThreads, kE4m3BlocksPerSm) gemm_e4m3(GemmParams p) {
#if defined(METRALE_HAVE_WGMMA)
  k::e4m3_block_sm90(p);
#else
  k::simple::block<true>(p);
#endif
}

// The fused prefill kernel on the decode layout (fused_sm90.cuh), persistent: each block loops
// over tiles b, b + G, ... of the G blocks launched. Elsewhere a placeholder that publishes
// gemm_fused_absent: the launcher refuses it, and a launch that got here anyway traps rather than
// leave C unwritten.
__global__ void __launch_bounds__(kFusedThreads, kFusedBlocksPerSm) gemm_fused(GemmParams p) {
#if defined(METRALE_HAVE_WGMMA)
  k::fused_block_sm90(p);
#else
  (void)p;
  __trap();
#endif
}

// The grouped GEMMs (grouped.cuh): expert blockIdx.y's GEMM, or nothing where it has no rows.
__global__ void __launch_bounds__(tl::kDecodeThreads) gemm_grouped(GroupedGemmParams g) {
  k::grouped_block(g, [](const GemmParams& p) { k::decode_block(p); });
}

__global__ void __launch_bounds__(tl::kDecodeThreads) gemm_grouped_packed(GroupedGemmParams g) {
  k::grouped_block(g, [](const GemmParams& p) { k::decode_packed_block(p); });
}

__global__ void __launch_bounds__(tl::kDecodeThreads)
    gemm_grouped_int4_decode(GroupedGemmParams g) {
  k::grouped_block(g, [](const GemmParams& p) { k::decode_int4_block(p); });
}

// The grouped decode kernels' split-K reduction: block (x, y) sums columns [256 x, 256 x + 256)
// of expert y's rows, its slices in order (split_reduce.cuh), or nothing where it has no rows.
__global__ void __launch_bounds__(kThreads) gemm_grouped_split_reduce(GroupedGemmParams g) {
  k::grouped_split_reduce_block<kThreads>(g);
}

// gemm_fused over the experts (fused_sm90.cuh with GroupedGemmParams): each block walks the
// layer's tiles, every expert's rows in slots of 128. A placeholder without wgmma, as gemm_fused.
__global__ void __launch_bounds__(kFusedThreads, kFusedBlocksPerSm)
    gemm_grouped_fused(GroupedGemmParams g) {
#if defined(METRALE_HAVE_WGMMA)
  k::grouped_fused_block_sm90(g);
#else
  (void)g;
  __trap();
#endif
}

// gemm_grouped_fused on INT4 experts (fused_sm90.cuh's FusedInt4 consumers). A placeholder
// without wgmma, as gemm_fused.
__global__ void __launch_bounds__(kFusedThreads, kFusedBlocksPerSm)
    gemm_grouped_int4_fused(GroupedGemmParams g) {
#if defined(METRALE_HAVE_WGMMA)
  k::grouped_int4_fused_block_sm90(g);
#else
  (void)g;
  __trap();
#endif
}

}  // extern "C"
