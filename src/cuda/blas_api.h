// cuBLASLt, reached only through this table of function pointers. The real table is filled at
// run time from libcublasLt.so.13 or .12 (never linked); tests fill it with a fake that computes
// in host memory (tests/cuda/fake_blas.h). Nothing outside src/cuda and the tests includes
// cublasLt.h.
#pragma once

// The toolkit's headers are not written for this project's warnings; only types, enums and the
// prototypes the table is typed from are taken from them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wold-style-cast"
#include <cublasLt.h>
#pragma GCC diagnostic pop

namespace metrale::cuda {

// Every cuBLASLt entry point metrale uses (exported under these names by .so.12 and .so.13).
#define METRALE_BLAS_FUNCTIONS(X)         \
  X(cublasLtGetVersion)                   \
  X(cublasLtGetStatusName)                \
  X(cublasLtCreate)                       \
  X(cublasLtDestroy)                      \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmulAlgoConfigGetAttribute) \
  X(cublasLtMatmul)

// The table. Members are named after the entry points and typed from their prototypes in
// cublasLt.h, so a call through the table is checked like a call to the library.
struct BlasApi {
#define METRALE_BLAS_MEMBER(name) decltype(&::name) name = nullptr;
  METRALE_BLAS_FUNCTIONS(METRALE_BLAS_MEMBER)
#undef METRALE_BLAS_MEMBER
};

}  // namespace metrale::cuda
