#include "cuda/driver_loader.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <memory>

#include "cuda/status.h"

namespace metrale::cuda {
namespace {

std::string version_str(int v) {
  return fmt::format("{}.{}", v / 1000, v % 1000 / 10);
}

// The reason when cuInit fails, worded for the person reading `metrale info`.
std::string init_failure(const char* library, CUresult status) {
  const std::string s = describe_status(nullptr, status);
  if (status == CUDA_ERROR_STUB_LIBRARY) {
    return fmt::format(
        "CUDA unavailable: {} is the CUDA toolkit's stub library, not an NVIDIA "
        "driver ({})",
        library, s);
  }
  if (status == CUDA_ERROR_NO_DEVICE)
    return fmt::format("CUDA unavailable: no CUDA device ({})", s);
  return fmt::format("CUDA unavailable: cuInit failed: {}", s);
}

}  // namespace

std::string driver_too_old(int driver_version) {
  if (driver_version >= kRequiredDriverVersion) return {};
  return fmt::format(
      "CUDA unavailable: the driver supports CUDA {}; the embedded kernels need {} "
      "or newer",
      version_str(driver_version), version_str(kRequiredDriverVersion));
}

DriverLoad load_driver_from(const char* library) {
  DriverLoad out;
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    out.reason = fmt::format("CUDA unavailable: cannot load {} ({}); no NVIDIA driver is installed",
                             library, err != nullptr ? err : "unknown error");
    return out;
  }
  // Until the table is complete, close the library on every early return.
  std::unique_ptr<void, int (*)(void*)> guard(handle, dlclose);

  auto* get_proc =
      reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(handle, "cuGetProcAddress_v2"));
  auto* init = reinterpret_cast<PFN_cuInit_v2000>(dlsym(handle, "cuInit"));
  auto* get_version =
      reinterpret_cast<PFN_cuDriverGetVersion_v2020>(dlsym(handle, "cuDriverGetVersion"));
  if (init == nullptr || get_version == nullptr) {
    out.reason = fmt::format("CUDA unavailable: {} exports no cuInit/cuDriverGetVersion", library);
    return out;
  }
  if (const CUresult s = init(0); s != CUDA_SUCCESS) {
    out.reason = init_failure(library, s);
    return out;
  }
  if (const CUresult s = get_version(&out.driver_version); s != CUDA_SUCCESS) {
    out.reason =
        fmt::format("CUDA unavailable: cuDriverGetVersion failed: {}", describe_status(nullptr, s));
    return out;
  }
  if (std::string old = driver_too_old(out.driver_version); !old.empty()) {
    out.reason = std::move(old);
    return out;
  }
  if (get_proc == nullptr) {
    out.reason = fmt::format("CUDA unavailable: {} exports no cuGetProcAddress_v2", library);
    return out;
  }

  auto api = std::make_unique<DriverApi>();
  std::string missing;
#define METRALE_DRIVER_RESOLVE(name, version)                                                 \
  {                                                                                           \
    void* fn = nullptr;                                                                       \
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;              \
    if (get_proc(#name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS || \
        fn == nullptr) {                                                                      \
      missing += missing.empty() ? #name : ", " #name;                                        \
    }                                                                                         \
    api->name = reinterpret_cast<PFN_##name##_v##version>(fn);                                \
  }
  METRALE_DRIVER_FUNCTIONS(METRALE_DRIVER_RESOLVE)
#undef METRALE_DRIVER_RESOLVE
  if (!missing.empty()) {
    out.reason = fmt::format("CUDA unavailable: driver {} lacks {}",
                             version_str(out.driver_version), missing);
    return out;
  }
  // The library stays loaded for the process: the table's pointers lead into it.
  guard.release();
  out.api = api.release();
  return out;
}

const DriverLoad& load_driver() {
  // A function-local static: built once, thread-safe, and the same answer for every caller.
  static const DriverLoad load = load_driver_from("libcuda.so.1");
  return load;
}

}  // namespace metrale::cuda
