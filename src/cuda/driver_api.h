// The CUDA driver, reached only through this table of function pointers. The real table is
// filled at run time from libcuda.so.1 (never linked); tests fill it with a fake driver that
// keeps everything in host memory. Nothing outside src/cuda includes cuda.h.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

namespace metrale::cuda {

// Every driver entry point metrale uses, with the ABI version it is requested at
// (cuGetProcAddress returns the variant of that version, e.g. cuMemAlloc at 3020 = _v2).
#define METRALE_DRIVER_FUNCTIONS(X)           \
  X(cuInit, 2000)                             \
  X(cuDriverGetVersion, 2020)                 \
  X(cuGetErrorName, 6000)                     \
  X(cuGetErrorString, 6000)                   \
  X(cuDeviceGetCount, 2000)                   \
  X(cuDeviceGet, 2000)                        \
  X(cuDeviceGetName, 2000)                    \
  X(cuDeviceGetAttribute, 2000)               \
  X(cuDeviceTotalMem, 3020)                   \
  X(cuDevicePrimaryCtxRetain, 7000)           \
  X(cuDevicePrimaryCtxRelease, 11000)         \
  X(cuCtxSetCurrent, 4000)                    \
  X(cuCtxSynchronize, 2000)                   \
  X(cuStreamCreate, 2000)                     \
  X(cuStreamDestroy, 4000)                    \
  X(cuStreamSynchronize, 2000)                \
  X(cuStreamWaitEvent, 3020)                  \
  X(cuStreamBeginCapture, 10010)              \
  X(cuStreamEndCapture, 10000)                \
  X(cuStreamIsCapturing, 10000)               \
  X(cuStreamGetCtx, 9020)                     \
  X(cuThreadExchangeStreamCaptureMode, 10010) \
  X(cuEventCreate, 2000)                      \
  X(cuEventDestroy, 4000)                     \
  X(cuEventRecord, 2000)                      \
  X(cuEventQuery, 2000)                       \
  X(cuEventSynchronize, 2000)                 \
  X(cuEventElapsedTime, 2000)                 \
  X(cuGraphInstantiateWithFlags, 11040)       \
  X(cuGraphDestroy, 10000)                    \
  X(cuGraphLaunch, 10000)                     \
  X(cuGraphExecDestroy, 10000)                \
  X(cuMemAlloc, 3020)                         \
  X(cuMemAllocManaged, 6000)                  \
  X(cuMemFree, 3020)                          \
  X(cuMemHostAlloc, 2020)                     \
  X(cuMemFreeHost, 2000)                      \
  X(cuMemHostGetDevicePointer, 3020)          \
  X(cuMemGetInfo, 3020)                       \
  X(cuMemcpyHtoDAsync, 3020)                  \
  X(cuMemcpyDtoHAsync, 3020)                  \
  X(cuMemcpyDtoDAsync, 3020)                  \
  X(cuMemcpy2DAsync, 3020)                    \
  X(cuMemsetD8Async, 3020)                    \
  X(cuModuleLoadData, 2000)                   \
  X(cuModuleUnload, 2000)                     \
  X(cuModuleGetFunction, 2000)                \
  X(cuModuleGetGlobal, 3020)                  \
  X(cuFuncSetAttribute, 9000)                 \
  X(cuLaunchKernel, 4000)                     \
  METRALE_DRIVER_VMM_FUNCTIONS(X)

// The virtual memory calls of lazy buffers (cuda/lazy_buffer.cpp), the end of the table above.
#define METRALE_DRIVER_VMM_FUNCTIONS(X)   \
  X(cuMemGetAllocationGranularity, 10020) \
  X(cuMemAddressReserve, 10020)           \
  X(cuMemAddressFree, 10020)              \
  X(cuMemCreate, 10020)                   \
  X(cuMemRelease, 10020)                  \
  X(cuMemMap, 10020)                      \
  X(cuMemUnmap, 10020)                    \
  X(cuMemSetAccess, 10020)

// The table. Members are named after the entry points and typed by cudaTypedefs.h's PFN_ of the
// requested version, so a call through the table is checked like a call to the driver.
struct DriverApi {
#define METRALE_DRIVER_MEMBER(name, version) PFN_##name##_v##version name = nullptr;
  METRALE_DRIVER_FUNCTIONS(METRALE_DRIVER_MEMBER)
#undef METRALE_DRIVER_MEMBER
};

}  // namespace metrale::cuda
