// The CUDA backend's dense GEMMs (metrale/dense_gemm.h) on cuBLASLt: one library handle per
// backend, the heuristic asked once per shape and its answer memoized here, and each run queued
// on the caller's stream with the caller's workspace (the ops give every stream its own, so two
// GEMMs on two streams never share one).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/blas_api.h"
#include "cuda/blas_loader.h"
#include "cuda/host.h"
#include "metrale/dense_gemm.h"

namespace metrale::cuda {

// The most workspace the heuristic may choose an algorithm for; a plan records what its
// algorithm needs, which is often less (0 for many shapes).
inline constexpr std::uint64_t kMaxDenseWorkspace = std::uint64_t{32} << 20;

// Why blas on a device of capability cc runs no dense GEMM of kind, or "" when it does.
std::string dense_gemm_unavailable(const BlasLoad& blas, ComputeCapability cc, DenseKind kind);

// One line for `metrale info`: the library (version, file) and the kinds it runs here, with the
// reason for each it does not; or why there is no library.
std::string describe_dense_gemms(const BlasLoad& blas, ComputeCapability cc);

class DenseGemms {
 public:
  // The dense GEMMs of a backend on host (which outlives this object).
  explicit DenseGemms(CudaHost& host) : host_(host) {}
  DenseGemms(const DenseGemms&) = delete;
  DenseGemms& operator=(const DenseGemms&) = delete;
  // Destroys the cuBLASLt handle if one was made; a failure is logged, never thrown.
  ~DenseGemms();

  // Why this backend runs no dense GEMM of kind ("" when it does); loads the library on first use.
  std::string unavailable(DenseKind kind) const;
  // The memoized plan for an available, checked shape: the first call per shape asks the
  // heuristic (Error(kNotFound) naming cublasLtMatmulAlgoGetHeuristic when it has no
  // algorithm, Error(kDriver) naming the call that failed otherwise); later calls return the
  // same plan without asking. An FP8 N or K the library's documentation excludes is
  // Error(kUnavailable) naming the rule, before the heuristic. The plan's workspace holds the
  // algorithm's and, where the library's rules need them, a padded A and D (M off a multiple of
  // 4 for the block scalings) and an FP32 bias (BF16 with FP32 C).
  DenseGemmPlan plan(const DenseGemmShape& shape);
  // Queues a checked run on stream (the context is current): the padding copies, the library
  // call, the copy of the real rows out. Error(kInvalidArgument) when the plan is not one this
  // object made for its shape; Error(kDriver) naming the failed call.
  void run(const DenseGemmPlan& plan, const DenseGemmArgs& args, CUstream stream);

 private:
  struct Choice {
    DenseGemmShape shape;
    cublasLtMatmulAlgo_t algo{};
    std::uint64_t workspace = 0;  // what the algorithm needs, at the workspace's start
    std::uint64_t total = 0;      // that and the padded buffers after it (dense_gemm.cpp)
    std::string describe;
  };
  using Key = std::tuple<int, std::int64_t, std::int64_t, std::int64_t, bool, bool>;

  // The library's table (only called once unavailable() said it is usable).
  const BlasApi& api() const { return *host_.blas().api; }
  // The handle, made on first use; mu_ held.
  cublasLtHandle_t handle_locked(std::string_view call);

  CudaHost& host_;
  std::mutex mu_;  // the handle and the memo; held across the heuristic, so it runs once per shape
  cublasLtHandle_t handle_ = nullptr;
  std::map<Key, std::size_t> index_;  // shape → memo_ slot
  std::vector<Choice> memo_;          // a plan's algorithm is its slot + 1
};

}  // namespace metrale::cuda
