#include "core/nvtx.h"

#include <dlfcn.h>

#include "core/log.h"

namespace metrale::nvtx {
namespace {

// The two entry points of the NVTX v2 C API that ranges need.
struct Api {
  int (*push)(const char*) = nullptr;
  int (*pop)() = nullptr;
};

Api load() {
  void* lib = dlopen("libnvToolsExt.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return {};
  Api api;
  // POSIX: a function pointer may be converted from dlsym's void*.
  api.push = reinterpret_cast<int (*)(const char*)>(dlsym(lib, "nvtxRangePushA"));
  api.pop = reinterpret_cast<int (*)()>(dlsym(lib, "nvtxRangePop"));
  if (api.push == nullptr || api.pop == nullptr) {
    log::warn("libnvToolsExt.so.1 lacks nvtxRangePushA or nvtxRangePop; ops get no NVTX ranges");
    dlclose(lib);
    return {};
  }
  log::debug("NVTX ranges on (libnvToolsExt.so.1 loaded)");
  return api;  // the library stays loaded for the process
}

const Api& api() noexcept {
  static const Api a = load();
  return a;
}

}  // namespace

bool available() noexcept {
  return api().push != nullptr;
}

Range::Range(const char* name) noexcept : pushed_(api().push != nullptr) {
  if (pushed_) api().push(name);
}

Range::~Range() {
  if (pushed_) api().pop();
}

}  // namespace metrale::nvtx
