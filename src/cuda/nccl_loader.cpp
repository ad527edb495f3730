#include "cuda/nccl_loader.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

#include "cuda/nccl_api.h"

namespace metrale::cuda {

std::string nccl_version_string(int v) {
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

NcclLoad load_nccl_from(const char* library) {
  NcclLoad out;
  out.library = library;
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    out.reason = fmt::format("NCCL unavailable: cannot load {} ({})", library,
                             err != nullptr ? err : "unknown error");
    return out;
  }
  std::unique_ptr<void, int (*)(void*)> guard(handle, dlclose);
  auto api = std::make_unique<NcclApi>();
  std::string missing;
#define METRALE_NCCL_RESOLVE(name)                                       \
  api->name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name)); \
  if (api->name == nullptr) missing += missing.empty() ? #name : ", " #name;
  METRALE_NCCL_FUNCTIONS(METRALE_NCCL_RESOLVE)
#undef METRALE_NCCL_RESOLVE
  if (!missing.empty()) {
    out.reason = fmt::format("NCCL unavailable: {} lacks {}", library, missing);
    return out;
  }
  if (api->ncclGetVersion(&out.version) != ncclSuccess) {
    out.reason = fmt::format("NCCL unavailable: {} does not report its version", library);
    return out;
  }
  if (out.version < kMinNcclVersion) {
    out.reason =
        fmt::format("NCCL unavailable: {} is NCCL {}; metrale needs {} or newer", library,
                    nccl_version_string(out.version), nccl_version_string(kMinNcclVersion));
    return out;
  }
  guard.release();  // the table's pointers lead into the library for the rest of the process
  out.api = api.release();
  return out;
}

const NcclLoad& load_nccl() {
  // METRALE_NCCL_LIBRARY, when set, is the one place tried (a path, e.g. PyPI's
  // nvidia/nccl/lib/libnccl.so.2). Otherwise the loader's search path, then the toolkit's usual
  // homes; the first that loads wins, and a failure names every place tried.
  static const NcclLoad load = [] {
    std::vector<std::string> places;
    if (const char* env = std::getenv("METRALE_NCCL_LIBRARY"); env != nullptr && *env != 0) {
      places.emplace_back(env);
    } else {
      for (const char* p : {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2",
                            "/usr/local/cuda/lib/libnccl.so.2"}) {
        places.emplace_back(p);
      }
    }
    std::string reasons;
    NcclLoad last;
    for (const std::string& place : places) {
      last = load_nccl_from(place.c_str());
      if (last.api != nullptr) return last;
      reasons += reasons.empty() ? "" : "; ";
      reasons += last.reason.substr(std::string_view("NCCL unavailable: ").size());
    }
    last.reason = "NCCL unavailable: " + reasons;
    return last;
  }();
  return load;
}

}  // namespace metrale::cuda
