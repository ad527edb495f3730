#include "cuda/blas_loader.h"

#include "cuda/blas_api.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <memory>
#include <string_view>

namespace metrale::cuda {

std::string blas_version_string(std::size_t v) {
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

BlasLoad load_blas_from(const char* library) {
  BlasLoad out;
  out.library = library;
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    out.reason = fmt::format("cuBLASLt unavailable: cannot load {} ({})", library,
                             err != nullptr ? err : "unknown error");
    return out;
  }
  // Until the table is complete, close the library on every early return.
  std::unique_ptr<void, int (*)(void*)> guard(handle, dlclose);
  auto api = std::make_unique<BlasApi>();
  std::string missing;
#define METRALE_BLAS_RESOLVE(name)                                       \
  api->name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name)); \
  if (api->name == nullptr) missing += missing.empty() ? #name : ", " #name;
  METRALE_BLAS_FUNCTIONS(METRALE_BLAS_RESOLVE)
#undef METRALE_BLAS_RESOLVE
  if (!missing.empty()) {
    out.reason = fmt::format("cuBLASLt unavailable: {} lacks {}", library, missing);
    return out;
  }
  out.version = api->cublasLtGetVersion();
  // The library stays loaded for the process: the table's pointers lead into it.
  guard.release();
  out.api = api.release();
  return out;
}

const BlasLoad& load_blas() {
  // A function-local static: built once, thread-safe, the same answer for every caller. Major
  // 13 first (the toolkit the kernels are built with), then 12 (12.9 has block scaling too).
  static const BlasLoad load = [] {
    BlasLoad first = load_blas_from("libcublasLt.so.13");
    if (first.api != nullptr) return first;
    BlasLoad second = load_blas_from("libcublasLt.so.12");
    if (second.api != nullptr) return second;
    second.reason =
        fmt::format("{}; {}", first.reason,
                    second.reason.substr(std::string_view("cuBLASLt unavailable: ").size()));
    return second;
  }();
  return load;
}

}  // namespace metrale::cuda
