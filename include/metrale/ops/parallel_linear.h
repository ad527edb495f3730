// Tensor-parallel linear layers over a Communicator (docs/ARCHITECTURE.md, "Tensor
// parallelism"). Column-parallel: W [N, K] is split along N into equal shards, rank r holding
// rows [r·N/size, (r+1)·N/size); each rank computes its columns of C = A · Wᵀ with the ordinary
// GEMM (plan → run) and the shards are gathered into C [M, N], or left sharded for a next layer
// that is split along K (metrale/sharded_checkpoint.h's shard_slice and
// load_nvfp4_linear_shard give a rank its slice). Row-parallel: W is split along K at multiples of
// the scale group, rank r holding those columns of W and of A; each rank's GEMM writes its partial
// sums in FP32, the partials are summed across ranks in FP32 in the communicator's fixed order, and
// the sum is rounded once to BF16.
#pragma once

#include <cstdint>

#include "metrale/communicator.h"
#include "metrale/handles.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/gemm.h"

namespace metrale::ops {

// Gathers each rank's C_local [M, n_local] (BF16) into C [M, n_local × size], rank r's columns
// at r × n_local: an all-gather into OpCache scratch, then one pitched copy per rank on stream.
// Throws what the communicator throws; Error(kInvalidArgument) for bad sizes or buffers.
void gather_columns(Communicator& comm, DevicePtr c_local, std::int64_t m, std::int64_t n_local,
                    DevicePtr c, StreamHandle stream = {});

// One column-parallel layer on this rank (a null stream: the backend's default): runs plan (made
// for this rank's shard w_local, with its M) into c_local [M, n_local], then, when c is not null,
// gathers every rank's shard into c [M, n_local × size]. Every rank calls it with the same M; a
// rank whose GEMM throws tells the others (Communicator::abort) before the error goes on, so none
// of them waits out its timeout.
void column_parallel_gemm(Communicator& comm, const GemmPlan& plan, StreamHandle stream,
                          DevicePtr a, const QuantWeights& w_local, DevicePtr c_local,
                          DevicePtr c = {});

// One row-parallel layer on this rank (a null stream: the backend's default): runs plan (made
// for this rank's shard w_local with GemmOptions::out_f32, and with the bias on rank 0 alone)
// on a_local [M, K_local] into FP32 scratch, sums the ranks' partials (all_reduce_sum, FP32) and
// rounds the sum once into c [M, N] (BF16). Every rank ends with the same bits, run after run.
// Throws Error(kInvalidArgument) for a plan without FP32 output or with the bias on another rank
// than 0; a rank whose GEMM throws tells the others before the error goes on.
void row_parallel_gemm(Communicator& comm, const GemmPlan& plan, StreamHandle stream,
                       DevicePtr a_local, const QuantWeights& w_local, DevicePtr c,
                       DevicePtr bias = {});

// The W8A8 (block-FP8) layers, with the same rules: W and its scales cut at 128-blocks
// (metrale/ops/fp8_slices.h), so along K each rank casts its own whole 128-blocks of A exactly as
// one rank would; the row-parallel plan is made with Fp8GemmOptions::out_f32.
void column_parallel_gemm(Communicator& comm, const Fp8GemmPlan& plan, StreamHandle stream,
                          DevicePtr a, const Fp8Weights& w_local, DevicePtr c_local,
                          DevicePtr c = {});
void row_parallel_gemm(Communicator& comm, const Fp8GemmPlan& plan, StreamHandle stream,
                       DevicePtr a_local, const Fp8Weights& w_local, DevicePtr c,
                       DevicePtr bias = {});

}  // namespace metrale::ops
