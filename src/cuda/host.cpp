#include "cuda/host.h"

#include <fmt/format.h>

#include <mutex>
#include <optional>
#include <variant>

#include "core/log.h"
#include "cuda/driver_loader.h"
#include "metrale/error.h"

namespace metrale::cuda {
namespace {

int attribute(const DriverApi& api, CUdevice dev, CUdevice_attribute a, const char* what) {
  int v = 0;
  if (const CUresult s = api.cuDeviceGetAttribute(&v, a, dev); s != CUDA_SUCCESS) {
    throw_status(&api, "cuda", fmt::format("cuDeviceGetAttribute({})", what), s);
  }
  return v;
}

}  // namespace

DeviceInfo query_device(const DriverApi& api, int ordinal) {
  int count = 0;
  if (const CUresult s = api.cuDeviceGetCount(&count); s != CUDA_SUCCESS) {
    throw_status(&api, "cuda", "cuDeviceGetCount", s);
  }
  if (count == 0) throw Error(ErrorCode::kUnavailable, "cuda", "CUDA unavailable: no CUDA device");
  if (ordinal < 0 || ordinal >= count) {
    throw Error(ErrorCode::kUnavailable, "cuda",
                fmt::format("CUDA unavailable: device ordinal {} does not exist ({} device(s))",
                            ordinal, count));
  }
  CUdevice dev = 0;
  if (const CUresult s = api.cuDeviceGet(&dev, ordinal); s != CUDA_SUCCESS) {
    throw_status(&api, "cuda", "cuDeviceGet", s);
  }
  DeviceInfo info;
  info.ordinal = ordinal;
  char name[256] = {};
  if (const CUresult s = api.cuDeviceGetName(name, sizeof name - 1, dev); s != CUDA_SUCCESS) {
    throw_status(&api, "cuda", "cuDeviceGetName", s);
  }
  info.name = name;
  info.cc.major = attribute(api, dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cc major");
  info.cc.minor = attribute(api, dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cc minor");
  info.sm_count = attribute(api, dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count");
  info.integrated = attribute(api, dev, CU_DEVICE_ATTRIBUTE_INTEGRATED, "integrated") != 0;
  info.managed_memory =
      attribute(api, dev, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, "managed memory") != 0;
  info.max_shared_optin = attribute(api, dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                    "max shared memory per block (opt-in)");
  if (const CUresult s = api.cuDeviceTotalMem(&info.total_memory, dev); s != CUDA_SUCCESS) {
    throw_status(&api, "cuda", "cuDeviceTotalMem", s);
  }
  return info;
}

std::shared_ptr<CudaHost> CudaHost::create(const DriverApi& api, int ordinal, int driver_version,
                                           BlasSource blas) {
  DeviceInfo info = query_device(api, ordinal);
  info.driver_version = driver_version;
  std::shared_ptr<CudaHost> host(new CudaHost(api, std::move(info)));
  host->blas_source_ = std::move(blas);
  if (const CUresult s = api.cuDeviceGet(&host->device_, ordinal); s != CUDA_SUCCESS) {
    throw_status(&api, "cuda", "cuDeviceGet", s);
  }
  if (const CUresult s = api.cuDevicePrimaryCtxRetain(&host->context_, host->device_);
      s != CUDA_SUCCESS) {
    host->context_ = nullptr;
    throw_status(&api, "cuda", "cuDevicePrimaryCtxRetain", s);
  }
  host->bind();
  // Non-blocking: the host's stream must not serialize with the legacy default stream that
  // other libraries in the process may use.
  if (const CUresult s = api.cuStreamCreate(&host->stream_, CU_STREAM_NON_BLOCKING);
      s != CUDA_SUCCESS) {
    host->stream_ = nullptr;
    throw_status(&api, "cuda", "cuStreamCreate", s);
  }
  return host;
}

CudaHost::~CudaHost() {
  bind_quietly();  // the host may be dropped on a thread that never used it
  if (stream_ != nullptr) {
    if (const CUresult s = api_->cuStreamDestroy(stream_);
        s != CUDA_SUCCESS && !is_context_gone(s)) {
      log::warn("cuda host: cuStreamDestroy failed: {}", describe_status(api_, s));
    }
  }
  if (context_ != nullptr) {
    if (const CUresult s = api_->cuDevicePrimaryCtxRelease(device_);
        s != CUDA_SUCCESS && !is_context_gone(s)) {
      log::warn("cuda host: cuDevicePrimaryCtxRelease failed: {}", describe_status(api_, s));
    }
  }
}

std::shared_ptr<CudaHost> CudaHost::process(int ordinal) {
  // The first creation decides for the whole process: its host, or its error, is what every
  // later caller gets. The host is never destroyed (see ~CudaHost).
  struct Slot {
    std::once_flag once;
    int ordinal = -1;
    std::shared_ptr<CudaHost> host;
    std::optional<Error> error;
  };
  static Slot* slot = new Slot();
  std::call_once(slot->once, [&] {
    slot->ordinal = ordinal;
    try {
      const DriverLoad& load = load_driver();
      if (load.api == nullptr) throw Error(ErrorCode::kUnavailable, "cuda", load.reason);
      slot->host = create(*load.api, ordinal, load.driver_version, [] { return load_blas(); });
      // Keep the process host alive past every static destructor.
      new std::shared_ptr<CudaHost>(slot->host);
    } catch (const Error& e) {
      slot->error = e;
    } catch (const std::exception& e) {
      slot->error = Error(ErrorCode::kInternal, "cuda", e.what());
    }
  });
  if (slot->ordinal != ordinal) {
    throw Error(ErrorCode::kInvalidArgument, "cuda",
                fmt::format("this process uses CUDA device {}; device {} cannot be added",
                            slot->ordinal, ordinal));
  }
  if (slot->error) throw *slot->error;
  return slot->host;
}

const BlasLoad& CudaHost::blas() const {
  std::call_once(blas_once_, [this] {
    if (!blas_source_) {
      blas_.reason = "cuBLASLt unavailable: this CUDA host was made without the library";
      return;
    }
    try {
      blas_ = blas_source_();
      if (blas_.api == nullptr && blas_.reason.empty())
        blas_.reason = "cuBLASLt unavailable: its loader gave no table and no reason";
    } catch (const std::exception& e) {  // a source is not supposed to throw; say so, never crash
      blas_ = BlasLoad{};
      blas_.reason = fmt::format("cuBLASLt unavailable: loading it threw: {}", e.what());
    }
  });
  return blas_;
}

void CudaHost::bind() const {
  if (const CUresult s = api_->cuCtxSetCurrent(context_); s != CUDA_SUCCESS) {
    throw_status(api_, "bind_to_thread", "cuCtxSetCurrent", s);
  }
}

void CudaHost::bind_quietly() const noexcept {
  if (context_ != nullptr) static_cast<void>(api_->cuCtxSetCurrent(context_));
}

void CudaHost::probe_fault() {
  if (!fault_.latch(api_, api_->cuCtxSynchronize())) return;
  log::error("cuda: device {} ({}) is faulted: {}; every later call will fail", info_.ordinal,
             info_.name, fault_reason());
}

}  // namespace metrale::cuda
