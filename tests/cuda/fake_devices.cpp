// The fake driver's initialisation, versions, status names, devices and primary contexts.
#include "cuda/fake_state.h"
#include "cuda/status.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace metrale::cuda::testing::fake {

CUresult fake_cuInit(unsigned int flags) {
  FAKE_ENTER(Need::kNothing);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (s.init_status == CUDA_SUCCESS) s.initialized = true;
  return s.init_status;
}

CUresult fake_cuDriverGetVersion(int* version) {
  FAKE_ENTER(Need::kNothing);
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = s.driver_version;
  return CUDA_SUCCESS;
}

// Statuses cuda.h defines (status_name knows them all); others are refused, as by the driver.
bool known_status(CUresult error) {
  return std::strcmp(status_name(error), "CUDA_ERROR_UNRECOGNIZED") != 0;
}

CUresult fake_cuGetErrorName(CUresult error, const char** str) {
  FAKE_ENTER(Need::kNothing);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *str = known_status(error) ? status_name(error) : nullptr;
  return *str != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// Short descriptions, in the driver's words; other known statuses get a generic one.
constexpr std::pair<CUresult, const char*> kDescriptions[] = {
    {CUDA_SUCCESS, "no error"},
    {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
     "operation failed due to a previous error during capture"},
};

CUresult fake_cuGetErrorString(CUresult error, const char** str) {
  FAKE_ENTER(Need::kNothing);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *str = nullptr;
  if (!known_status(error)) return CUDA_ERROR_INVALID_VALUE;
  *str = "an error reported by the fake CUDA driver";
  for (const auto& [status, text] : kDescriptions) {
    if (status == error) *str = text;
  }
  return CUDA_SUCCESS;
}

bool valid_device(const State& s, CUdevice dev) {
  return dev >= 0 && static_cast<std::size_t>(dev) < s.devices.size();
}

CUresult fake_cuDeviceGetCount(int* count) {
  FAKE_ENTER(Need::kInit);
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = static_cast<int>(s.devices.size());
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGet(CUdevice* device, int ordinal) {
  FAKE_ENTER(Need::kInit);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGetName(char* name, int len, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  const std::string& text = s.devices[dev].name;
  const std::size_t n = std::min(text.size(), static_cast<std::size_t>(len) - 1);
  std::memcpy(name, text.data(), n);
  name[n] = '\0';
  return CUDA_SUCCESS;
}

// The attribute's value (H100/H200 limits where FakeDevice has no field), or -1 for one the
// fake does not know.
int attribute(const FakeDevice& d, CUdevice_attribute attrib) {
  const std::pair<CUdevice_attribute, int> table[] = {
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d.cc_major},
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d.cc_minor},
      {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d.sm_count},
      {CU_DEVICE_ATTRIBUTE_INTEGRATED, d.integrated ? 1 : 0},
      {CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, d.managed_memory ? 1 : 0},
      {CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, d.managed_memory ? 1 : 0},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, kSharedOptin},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, kDefaultDynamicShared},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, kSharedOptin + 1024},
      {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024},
      {CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, 2147483647},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535},
      {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
      {CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1},
  };
  for (const auto& [a, v] : table) {
    if (a == attrib) return v;
  }
  return -1;
}

CUresult fake_cuDeviceGetAttribute(int* value, CUdevice_attribute attrib, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  const int v = attribute(s.devices[dev], attrib);
  if (v < 0) return CUDA_ERROR_INVALID_VALUE;
  *value = v;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceTotalMem(std::size_t* bytes, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = s.devices[dev].total_memory;
  return CUDA_SUCCESS;
}

CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  ++s.retains[dev];
  *ctx = s.contexts[dev];
  return CUDA_SUCCESS;
}

CUresult fake_cuDevicePrimaryCtxRelease(CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (s.retains[dev] == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --s.retains[dev];
  return CUDA_SUCCESS;
}

// Current per thread, as in the driver; only a retained primary context (or null) is accepted.
CUresult fake_cuCtxSetCurrent(CUcontext ctx) {
  FAKE_ENTER(Need::kInit);
  if (ctx != nullptr) {
    bool live = false;
    for (std::size_t d = 0; d < s.contexts.size(); ++d) {
      live = live || (s.contexts[d] == ctx && s.retains[d] > 0);
    }
    if (!live) return CUDA_ERROR_INVALID_CONTEXT;
  }
  t_current = Current{s.id, ctx};
  return CUDA_SUCCESS;
}

// Synchronizing the device cannot be captured: every capture in progress is invalidated.
CUresult fake_cuCtxSynchronize() {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  bool capturing = false;
  for (auto& [handle, st] : s.streams) {
    if (st.capture != CU_STREAM_CAPTURE_STATUS_NONE) {
      capturing = true;
      invalidate(st);
    }
  }
  return capturing ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

}  // namespace metrale::cuda::testing::fake
