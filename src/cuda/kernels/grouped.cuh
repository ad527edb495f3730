// The grouped GEMMs' block (kernels/grouped_params.h): expert blockIdx.y's arguments found by
// thread 0 and shared through shared memory, then the decode kernel of the weights' layout on them.
// Held in registers beside the decode kernels' own (255 of them already), the expert's arguments
// spilled on sm_80 and sm_90a; read from shared memory they do not.
#pragma once

#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "split_reduce.cuh"

namespace metrale::kernels {

// Runs block(p) on expert blockIdx.y's GEMM p, or nothing where the expert has no rows (the whole
// block leaves together).
template <class Block>
__device__ __forceinline__ void grouped_block(const GroupedGemmParams& g, Block block) {
  __shared__ GemmParams p;
  __shared__ bool has_rows;
  if (threadIdx.x == 0) has_rows = grouped::expert_params(g, blockIdx.y, &p);
  __syncthreads();
  if (has_rows) block(p);
}

// gemm_grouped_split_reduce's block: columns [Tile·blockIdx.x, Tile·blockIdx.x + Tile) of expert
// blockIdx.y's rows, a thread per column (Tile threads a block), each expert's K slices summed in
// order into its rows of C.
template <int Tile>
__device__ __forceinline__ void grouped_split_reduce_block(const GroupedGemmParams& g) {
  grouped_block(g, [](const GemmParams& p) {
    split_reduce_column(p, static_cast<std::int64_t>(blockIdx.x) * Tile + threadIdx.x);
  });
}

}  // namespace metrale::kernels
