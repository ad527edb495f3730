// The backend registry: the one file that knows every backend, above core, cpu/ and cuda/ (core
// knows none of them). Each backend says whether it can be opened, and why not, as data.
#include <fmt/format.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "core/published.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/runtime.h"
#if METRALE_HAVE_CUDA
#include "cuda/discovery.h"
#endif

namespace metrale {
namespace {

// What opening the CUDA backend gave: a backend, or the reason and the error to throw.
struct CudaOpening {
  std::unique_ptr<Backend> backend;  // null when unavailable
  std::string reason;                // "CUDA unavailable: ...", when unavailable
  std::optional<Error> error;        // what asking for it by name throws, when unavailable
};

CudaOpening open_cuda() {
#if METRALE_HAVE_CUDA
  cuda::Opening opening = cuda::open_backend();
  if (auto* no = std::get_if<cuda::Unavailable>(&opening)) {
    return {nullptr, std::move(no->reason), std::move(no->error)};
  }
  return {std::move(std::get<std::unique_ptr<CudaBackend>>(opening)), {}, std::nullopt};
#else
  std::string reason =
      "CUDA unavailable: this build of metrale has no CUDA backend (no CUDA toolkit "
      "was found when it was built)";
  Error error(ErrorCode::kUnavailable, "create_backend", reason);
  return {nullptr, std::move(reason), std::move(error)};
#endif
}

BackendInfo describe_cuda() {
  CudaOpening opened = open_cuda();
  BackendInfo info;
  info.name = "cuda";
  if (opened.backend == nullptr) {
    info.reason = std::move(opened.reason);
    return info;
  }
#if METRALE_HAVE_CUDA
  try {
    info.properties = cuda::device_properties(static_cast<const CudaBackend&>(*opened.backend));
    info.modules = describe_modules(*opened.backend);
  } catch (const Error& e) {
    // A device that opened but cannot be listed is as unusable as one that did not open.
    return BackendInfo{"cuda", false, cuda::unavailable(e).reason, {}, {}, {}};
  }
#endif
  info.available = true;
  info.device = opened.backend->device_name();
  return info;
}

BackendInfo describe_cpu() {
  CpuBackend cpu;
  BackendInfo info{"cpu", true, {}, cpu.device_name(), {}, {}};
  info.properties = {
      {"memory", fmt::format("{:.1f} GiB total, {:.1f} GiB free",
                             static_cast<double>(cpu.total_memory()) / (1 << 30),
                             static_cast<double>(cpu.free_memory()) / (1 << 30))},
      {"threads", fmt::format("{}", cpu.sm_count())},
  };
  info.modules = describe_modules(cpu);
  return info;
}

}  // namespace

std::vector<ModuleDescription> describe_modules(Backend& backend) {
  std::vector<ModuleDescription> out;
  for (const ModuleListing& m : backend.modules()) {
    ModuleDescription d{m.name, m.target, {}};
    for (const std::string& k : m.kernels) {
      const ResolvedKernel& r = backend.op_cache().kernel(backend, m.name, k);
      d.kernels.push_back({k, r.meta.n_tile, r.meta.a_e4m3, verification_text(r.meta)});
    }
    out.push_back(std::move(d));
  }
  return out;
}

std::vector<BackendInfo> discover_backends() {
  std::vector<BackendInfo> out;
  out.push_back(describe_cuda());  // the preferred backend first
  out.push_back(describe_cpu());
  return out;
}

std::unique_ptr<Backend> create_backend(std::string_view which, std::string* why) {
  if (which == "cpu") {
    if (why != nullptr) *why = "cpu: asked for";
    return std::make_unique<CpuBackend>();
  }
  if (which == "cuda") {
    CudaOpening opened = open_cuda();
    if (opened.backend == nullptr) throw *opened.error;
    if (why != nullptr) *why = "cuda: asked for";
    return std::move(opened.backend);
  }
  if (which == "auto") {
    CudaOpening opened = open_cuda();
    if (opened.backend != nullptr) {
      if (why != nullptr)
        *why = fmt::format("cuda: {} is available", opened.backend->device_name());
      return std::move(opened.backend);
    }
    // Any CUDA failure leaves the CPU, which always works; the reason is kept for the caller.
    if (why != nullptr) *why = "cpu: " + opened.reason;
    return std::make_unique<CpuBackend>();
  }
  throw Error(ErrorCode::kInvalidArgument, "create_backend",
              fmt::format("unknown backend '{}' (expected auto, cpu or cuda)", which));
}

}  // namespace metrale
