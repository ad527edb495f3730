// The end of both decode kernels' rows: each warp's accumulators into shared memory, then the
// block's sum over its warps and the store (C, or split-K partials). Device code only.
#pragma once

#include <cstdint>

#include "epilogue.cuh"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"

namespace metrale::kernels {

namespace tl = metrale::tiles;

// Rows m0 .. m0 + 8 MT - 1 of columns n0 .. n0 + 31 from every warp's acc[row tile][activation
// tile] (the m16n8 accumulator fragments of a 32-column block), times `scale` (an exact power of
// two, or 1). Consecutive threads take consecutive columns, so the stores coalesce; warps are
// summed in index order, so the result does not depend on timing. Returns after the block is
// done with `red`, which the next rows may reuse.
template <int MT>
__device__ __forceinline__ void store_decode_rows(const GemmParams& p, const float (&acc)[2][MT][4],
                                                  std::int64_t n0, std::int64_t m0, float scale,
                                                  float (*red)[tl::kDecodeNTile][tl::kDecodeMaxM]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int rt = 0; rt < 2; ++rt) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        red[warp][16 * rt + tl::mma_acc_row(lane, i)][8 * mt + tl::mma_acc_col(lane, i)] =
            acc[rt][mt][i];
      }
    }
  }
  __syncthreads();
  for (int o = threadIdx.x; o < tl::kDecodeNTile * 8 * MT; o += tl::kDecodeThreads) {
    const int nl = o % tl::kDecodeNTile, ml = o / tl::kDecodeNTile;
    const std::int64_t n = n0 + nl, m = m0 + ml;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < tl::kDecodeWarps; ++w) sum += red[w][nl][ml];
    if (n < p.n && m < p.m) store_output(p, m, n, sum * scale);
  }
  __syncthreads();
}

}  // namespace metrale::kernels
