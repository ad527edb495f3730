#include "metrale/runtime.h"

#include <fmt/format.h>

#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#if METRALE_HAVE_CUDA
#include "cuda/cuda_runtime.h"
#endif

namespace metrale {
namespace {

BackendInfo probe_cuda() {
#if METRALE_HAVE_CUDA
  return cuda::probe();
#else
  BackendInfo info;
  info.name = "cuda";
  info.reason =
      "CUDA unavailable: this build of metrale has no CUDA backend (no CUDA toolkit "
      "was found when it was built)";
  return info;
#endif
}

std::unique_ptr<Backend> make_cuda() {
#if METRALE_HAVE_CUDA
  return cuda::create_backend();
#else
  throw Error(ErrorCode::kUnavailable, "create_backend", probe_cuda().reason);
#endif
}

}  // namespace

std::vector<ModuleDescription> describe_modules(Backend& backend) {
  std::vector<ModuleDescription> out;
  for (const ModuleListing& m : backend.modules()) {
    ModuleDescription d{m.name, m.target, {}};
    for (const std::string& k : m.kernels) {
      const ResolvedKernel& r = backend.op_cache().kernel(backend, m.name, k);
      d.kernels.push_back({k, r.meta.n_tile, r.meta.a_e4m3});
    }
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<BackendInfo> discover_backends() {
  std::vector<BackendInfo> out;
  out.push_back(probe_cuda());
  CpuBackend cpu;
  BackendInfo info{"cpu", true, {}, cpu.device_name(), {}, {}};
  info.properties = {
      {"memory", fmt::format("{:.1f} GiB total, {:.1f} GiB free",
                             static_cast<double>(cpu.total_memory()) / (1 << 30),
                             static_cast<double>(cpu.free_memory()) / (1 << 30))},
      {"threads", fmt::format("{}", cpu.sm_count())},
  };
  info.modules = describe_modules(cpu);
  out.push_back(std::move(info));
  return out;
}

std::unique_ptr<Backend> create_backend(std::string_view which, std::string* why) {
  if (which == "cpu") {
    if (why != nullptr) *why = "cpu: asked for";
    return std::make_unique<CpuBackend>();
  }
  if (which == "cuda") {
    std::unique_ptr<Backend> b = make_cuda();
    if (why != nullptr) *why = "cuda: asked for";
    return b;
  }
  if (which == "auto") {
    try {
      std::unique_ptr<Backend> b = make_cuda();
      if (why != nullptr) *why = fmt::format("cuda: {} is available", b->device_name());
      return b;
    } catch (const Error& e) {
      // Any CUDA failure leaves the CPU, which always works; the reason is kept for the caller.
      if (why != nullptr) {
        std::string reason = e.what();
        const auto pos = reason.find("CUDA unavailable:");
        *why = "cpu: " + (pos == std::string::npos ? reason : reason.substr(pos));
      }
    }
    return std::make_unique<CpuBackend>();
  }
  throw Error(ErrorCode::kInvalidArgument, "create_backend",
              fmt::format("unknown backend '{}' (expected auto, cpu or cuda)", which));
}

}  // namespace metrale
