// The CUDA host: one device ordinal's primary context and one non-blocking stream, shared by
// every model of the process, and that context's sticky-fault latch (the rules: status.h).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "cuda/blas_loader.h"
#include "cuda/driver_api.h"
#include "cuda/module_image.h"
#include "cuda/status.h"

namespace metrale::cuda {

// What the driver says about a device, read by ordinal without a context.
struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  ComputeCapability cc;
  int sm_count = 0;
  std::size_t total_memory = 0;
  bool integrated = false;
  bool managed_memory = false;
  int max_shared_optin = 0;  // bytes of dynamic shared memory a block may opt in to
  int driver_version = 0;
};

// Reads the device's properties (cuDeviceGet + attributes); throws Error naming the call.
DeviceInfo query_device(const DriverApi& api, int ordinal);

// Where a host's cuBLASLt comes from: called once, the first time the host is asked for it
// (loading the library costs time a process that runs no dense GEMM should not pay).
using BlasSource = std::function<BlasLoad()>;

class CudaHost {
 public:
  // Builds a host on api for ordinal: primary context retained, one non-blocking stream; its
  // cuBLASLt from blas (none when empty: dense GEMMs are then unavailable, with that reason).
  // Throws Error(kUnavailable) when the ordinal has no device, Error(kDriver) on other failures.
  static std::shared_ptr<CudaHost> create(const DriverApi& api, int ordinal, int driver_version,
                                          BlasSource blas = {});
  // The process-wide host on the real driver, built on first use. A failed first creation is
  // remembered and thrown again to every later caller; asking for another ordinal is an error.
  static std::shared_ptr<CudaHost> process(int ordinal);

  CudaHost(const CudaHost&) = delete;
  CudaHost& operator=(const CudaHost&) = delete;
  // Destroys the stream and releases the primary context (the process host is never destroyed:
  // at exit the driver may already be gone).
  ~CudaHost();

  const DriverApi& api() const noexcept { return *api_; }
  const DeviceInfo& info() const noexcept { return info_; }
  CUcontext context() const noexcept { return context_; }
  CUstream stream() const noexcept { return stream_; }
  // The host's cuBLASLt, loaded on the first call (thread-safe; the same answer afterwards).
  // Never throws: an unusable library is a BlasLoad with a reason.
  const BlasLoad& blas() const;

  // Makes the context current on the calling thread.
  void bind() const;
  // The same, for calls that must work whatever state the context is in (frees, destroys,
  // teardown): a failure is ignored, and the call that follows reports what it finds.
  void bind_quietly() const noexcept;
  // Throws Error(kDeviceFault) naming api when a sticky fault was latched.
  void check_not_faulted(std::string_view api) const { fault_.check(api); }
  // Called after a launch or memset failed: synchronizes once, and latches (and logs once) a
  // sticky fault if that is what the device reports.
  void probe_fault();
  // Whether a sticky fault was latched, and why.
  bool faulted() const noexcept { return fault_.faulted(); }
  std::string fault_reason() const { return fault_.reason(); }

 private:
  CudaHost(const DriverApi& api, DeviceInfo info) : api_(&api), info_(std::move(info)) {}

  const DriverApi* api_;
  DeviceInfo info_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  CUstream stream_ = nullptr;
  FaultLatch fault_;
  BlasSource blas_source_;
  mutable std::once_flag blas_once_;
  mutable BlasLoad blas_;
};

}  // namespace metrale::cuda
