// NCCL, reached only through this table of function pointers. The real table is filled at run
// time from libnccl.so.2 (the CUDA toolkit's or PyPI's nvidia-nccl-cu13; never linked); tests
// fill it with a fake (tests/cuda/fake_nccl.h). Nothing outside src/cuda and the tests includes
// nccl.h.
#pragma once

// nccl.h brings in the toolkit's FP8 header, whose inline conversions are not written for this
// project's warnings (they show at -O0).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wold-style-cast"
#pragma GCC diagnostic ignored "-Wconversion"
#include <nccl.h>
#pragma GCC diagnostic pop

namespace metrale::cuda {

// Every NCCL entry point metrale uses (all present since NCCL 2.14).
#define METRALE_NCCL_FUNCTIONS(X) \
  X(ncclGetVersion)               \
  X(ncclGetErrorString)           \
  X(ncclGetLastError)             \
  X(ncclGetUniqueId)              \
  X(ncclCommInitRankConfig)       \
  X(ncclCommGetAsyncError)        \
  X(ncclCommFinalize)             \
  X(ncclCommDestroy)              \
  X(ncclCommAbort)                \
  X(ncclAllReduce)                \
  X(ncclAllGather)                \
  X(ncclBroadcast)

// The table. Members are named after the entry points and typed from their prototypes.
struct NcclApi {
#define METRALE_NCCL_MEMBER(name) decltype(&::name) name = nullptr;
  METRALE_NCCL_FUNCTIONS(METRALE_NCCL_MEMBER)
#undef METRALE_NCCL_MEMBER
};

}  // namespace metrale::cuda
