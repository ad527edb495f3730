// Finding cuBLASLt at run time. Loading never crashes and never throws: a machine without a
// usable library gets a reason that starts with "cuBLASLt unavailable:", and the CUDA backend
// then offers no dense GEMM (everything else keeps working).
#pragma once

#include <cstddef>
#include <string>

namespace metrale::cuda {

struct BlasApi;  // cuda/blas_api.h (this header stays free of cuBLASLt's own)

// The first cublasLtGetVersion (major * 10000 + minor * 100 + patch) with block-scaled FP8 on
// sm_90 (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F and _BLK128x128_32F): 12.9.0.
inline constexpr std::size_t kBlockScaledBlasVersion = 120900;

struct BlasLoad {
  const BlasApi* api = nullptr;  // null when the library is unusable
  std::string reason;            // "cuBLASLt unavailable: ..." when api is null
  std::string library;           // the file that was loaded (or last tried)
  std::size_t version = 0;       // cublasLtGetVersion, when it could be asked
};

// "13.1.0" for 130100.
std::string blas_version_string(std::size_t version);

// Loads libcublasLt.so.13, else libcublasLt.so.12, once per process (thread-safe), and returns
// the same result every time.
const BlasLoad& load_blas();

// Loads the named library without caching (tests point it at missing files and libraries that
// lack the entry points). On success the library stays loaded for the rest of the process.
BlasLoad load_blas_from(const char* library);

}  // namespace metrale::cuda
