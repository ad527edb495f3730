// A fake cuBLASLt for tests: fills a BlasApi table with functions that model the library on the
// fake driver's memory (device pointers are host addresses there). cublasLtMatmul really
// computes, reading the descriptors as cuBLASLt does (column-major, TRANSA/TRANSB, the BIAS
// epilogue, the per-operand scale modes), so the CUDA backend's mapping of our row-major
// contract onto the library is what the tests check, not a copy of it:
//   BF16 x BF16: exact products, FP32 accumulation, one rounding to BF16;
//   E4M3 x E4M3: exact products summed in FP32 per 128 K, times the two operands' scales, summed
//     in FP32. Scale layouts as cuBLAS's documentation gives them (3.1.4.5.1 "Scaling factors
//     layouts"), for an operand whose scales cover outer x K (outer: M for A, N for B):
//     VEC128_32F s[kb * outer + o] (outer-major), BLK128x128_32F
//     s[(o / 128) * round_up(ceil(K / 128), 4) + kb] (K-major), SCALAR_32F s[0] (1 without a
//     pointer).
// It refuses what the documentation excludes, never what our own mapping happens to avoid
// (fake_blas.cpp cites each rule): FP8 outside "TN", Tensor Core Usage's 16-byte multiples
// (K, M x C's element size, every leading dimension) and 16-byte pointers, the block scalings
// on any device but compute capability 9.0 (the fake driver's current one), block-scaled M or N
// off a multiple of 4, BLK x BLK, a bias type the datatype tables do not list (BF16 inputs take
// a bias of D's type, FP32 with FP32 D; FP8 inputs take BF16): the heuristic and cublasLtMatmul
// answer CUBLAS_STATUS_NOT_SUPPORTED, misaligned pointers CUBLAS_STATUS_INVALID_VALUE.
// It checks that every buffer lies in a live fake allocation, and can be told to fail the
// load, the heuristic (a status or 0 results), to report a workspace size, and to fail matmul.
//
// Only one FakeBlas may exist at a time (the table's plain functions reach it through a
// process-wide pointer); constructing a second throws std::logic_error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/blas_api.h"
#include "cuda/blas_loader.h"
#include "cuda/host.h"

namespace metrale::cuda::testing {

// One cublasLtMatmul as the fake saw it.
struct FakeMatmul {
  cudaStream_t stream = nullptr;
  const void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::uint64_t rows = 0, cols = 0, inner = 0;  // D is rows x cols; inner is K
};

class FakeBlas {
 public:
  FakeBlas();
  FakeBlas(const FakeBlas&) = delete;
  FakeBlas& operator=(const FakeBlas&) = delete;
  ~FakeBlas();

  // What a host is given: the table, or after fail_load the reason with no table.
  BlasLoad load() const;
  // A source for CudaHost::create that answers load() (the fake must outlive the host).
  BlasSource source() const;

  // ---- set-up ----
  // The load fails with this reason ("cuBLASLt unavailable: ..." is the caller's to write).
  void fail_load(std::string reason);
  // What cublasLtGetVersion reports (default 130100, i.e. 13.1.0).
  void set_version(std::size_t version);
  // The heuristic returns status (CUBLAS_STATUS_SUCCESS: back to normal).
  void fail_heuristic(cublasStatus_t status);
  // The heuristic succeeds with no algorithm (true) or with one (false, the default).
  void no_algorithm(bool none);
  // The workspace the next heuristic answers report their algorithm needs (default 0).
  void set_workspace(std::size_t bytes);
  // cublasLtMatmul returns status and computes nothing (CUBLAS_STATUS_SUCCESS: normal).
  void fail_matmul(cublasStatus_t status);

  // ---- observation ----
  // How many times `call` (a name of METRALE_BLAS_FUNCTIONS) was made; std::invalid_argument
  // for any other name.
  std::uint64_t calls(const std::string& call) const;
  // Handles made and not destroyed.
  int live_handles() const;
  // Descriptors and layouts made and not destroyed (a leak shows here).
  int live_descriptors() const;
  // Every successful cublasLtMatmul, in order.
  std::vector<FakeMatmul> matmuls() const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace metrale::cuda::testing
