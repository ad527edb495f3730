// Column-parallel layers: the local GEMM is the ordinary one, and the gather re-lays the
// rank-major all-gather ([size][M][n_local]) into row-major C [M, N] with one pitched copy per
// rank, on the caller's stream.
#include "metrale/ops/parallel_linear.h"

#include <fmt/format.h>

#include <exception>
#include <string>

#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"

namespace metrale::ops {

void gather_columns(Communicator& comm, DevicePtr c_local, std::int64_t m, std::int64_t n_local,
                    DevicePtr c, StreamHandle stream) {
  constexpr std::string_view kApi = "gather_columns";
  if (m < 1 || n_local < 1) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("M = {} and n_local = {} must be positive", m, n_local));
  }
  Backend& backend = comm.backend();
  if (!stream) stream = backend.default_stream();
  const auto size = static_cast<std::uint64_t>(comm.size());
  const std::uint64_t row = static_cast<std::uint64_t>(n_local) * 2;  // BF16 bytes of a shard row
  const std::uint64_t shard = row * static_cast<std::uint64_t>(m);
  backend.check_range(kApi, "c", c, shard * size);
  if (comm.size() == 1) {
    backend.copy_d2d_async(c, c_local, shard, stream);
    return;
  }
  const DevicePtr gathered = backend.op_cache().scratch(
      backend, gemm_scratch_tag(backend, stream, "tp_gather"), shard * size, stream);
  comm.all_gather(c_local, gathered, shard, stream);
  for (std::uint64_t r = 0; r < size; ++r) {
    backend.copy_2d_async(c.offset(r * row), row * size, gathered.offset(r * shard), row, row,
                          static_cast<std::size_t>(m), stream);
  }
}

namespace {

// One column-parallel layer for either op (Plan: GemmPlan or Fp8GemmPlan).
template <class Plan, class Weights>
void column_parallel(Communicator& comm, const Plan& plan, StreamHandle stream, DevicePtr a,
                     const Weights& w_local, DevicePtr c_local, DevicePtr c) {
  if (plan.backend != &comm.backend()) {
    throw Error(ErrorCode::kInvalidArgument, "column_parallel_gemm",
                "the plan was made on another backend than the communicator's");
  }
  if (!stream) stream = comm.backend().default_stream();
  try {
    run(plan, stream, a, w_local, c_local, scratch_workspace(plan, stream));
  } catch (const std::exception& e) {
    // The others are about to wait for this rank's shard: tell them now.
    comm.abort(e.what());
    throw;
  }
  if (c) gather_columns(comm, c_local, plan.m, plan.n, c, stream);
}

// One row-parallel layer for either op; `fp32_option` names the option the plan needs.
template <class Plan, class Weights>
void row_parallel(Communicator& comm, const Plan& plan, StreamHandle stream, DevicePtr a_local,
                  const Weights& w_local, DevicePtr c, DevicePtr bias,
                  std::string_view fp32_option) {
  constexpr std::string_view kApi = "row_parallel_gemm";
  Backend& backend = comm.backend();
  if (plan.backend != &backend) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                "the plan was made on another backend than the communicator's");
  }
  if (!plan.out_f32) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("the plan writes BF16: a row-parallel rank's partial sums must stay "
                            "FP32 until the ranks' sum (plan with {})",
                            fp32_option));
  }
  if (bias && comm.rank() != 0) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("rank {} was given the bias: only rank 0 adds it, so that the sum "
                            "holds it once",
                            comm.rank()));
  }
  if (!stream) stream = backend.default_stream();
  const auto count = static_cast<std::size_t>(plan.m) * static_cast<std::size_t>(plan.n);
  const DevicePtr partial = backend.op_cache().scratch(
      backend, gemm_scratch_tag(backend, stream, "tp_partial"), count * sizeof(float), stream);
  try {
    run(plan, stream, a_local, w_local, partial, scratch_workspace(plan, stream), bias);
  } catch (const std::exception& e) {
    comm.abort(e.what());  // the others are about to wait for this rank's partial
    throw;
  }
  comm.all_reduce_sum(partial, partial, count, ReduceType::kF32, stream);
  cast_f32_to_bf16(backend, stream, partial, c, count);
}

}  // namespace

void column_parallel_gemm(Communicator& comm, const GemmPlan& plan, StreamHandle stream,
                          DevicePtr a, const QuantWeights& w_local, DevicePtr c_local,
                          DevicePtr c) {
  column_parallel(comm, plan, stream, a, w_local, c_local, c);
}

void column_parallel_gemm(Communicator& comm, const Fp8GemmPlan& plan, StreamHandle stream,
                          DevicePtr a, const Fp8Weights& w_local, DevicePtr c_local, DevicePtr c) {
  column_parallel(comm, plan, stream, a, w_local, c_local, c);
}

void row_parallel_gemm(Communicator& comm, const GemmPlan& plan, StreamHandle stream,
                       DevicePtr a_local, const QuantWeights& w_local, DevicePtr c,
                       DevicePtr bias) {
  row_parallel(comm, plan, stream, a_local, w_local, c, bias, "GemmOptions::out_f32");
}

void row_parallel_gemm(Communicator& comm, const Fp8GemmPlan& plan, StreamHandle stream,
                       DevicePtr a_local, const Fp8Weights& w_local, DevicePtr c, DevicePtr bias) {
  row_parallel(comm, plan, stream, a_local, w_local, c, bias, "Fp8GemmOptions::out_f32");
}

}  // namespace metrale::ops
