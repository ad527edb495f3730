#include "cuda/cuda_runtime.h"

#include <fmt/format.h>

#include "cuda/cuda_backend.h"
#include "cuda/driver_loader.h"
#include "metrale/error.h"

namespace metrale::cuda {

std::unique_ptr<Backend> create_backend() {
  std::shared_ptr<CudaHost> host = CudaHost::process(0);
  std::shared_ptr<ModuleRegistry> registry = ModuleRegistry::load(host, embedded_modules());
  auto backend = std::make_unique<CudaBackend>(host, std::move(registry));
  backend->require_kernels();
  return backend;
}

BackendInfo probe() {
  BackendInfo info;
  info.name = "cuda";
  try {
    std::unique_ptr<Backend> backend = create_backend();
    auto& cuda = static_cast<CudaBackend&>(*backend);
    const DeviceInfo& d = cuda.host().info();
    info.available = true;
    info.device = d.name;
    info.properties = {
        {"compute capability", fmt::format("{}.{}", d.cc.major, d.cc.minor)},
        {"SMs", fmt::format("{}", d.sm_count)},
        {"memory", fmt::format("{:.1f} GiB total, {:.1f} GiB free",
                               static_cast<double>(d.total_memory) / (1 << 30),
                               static_cast<double>(cuda.free_memory()) / (1 << 30))},
        {"driver",
         fmt::format("CUDA {}.{}", d.driver_version / 1000, d.driver_version % 1000 / 10)},
    };
    for (const std::string& s : cuda.registry().skipped())
      info.properties.push_back({"skipped", s});
    info.modules = describe_modules(*backend);
  } catch (const Error& e) {
    // "[cuda] CUDA unavailable: ..." → keep the reason readable without the API prefix.
    std::string reason = e.what();
    const auto pos = reason.find("CUDA unavailable:");
    info.reason = pos == std::string::npos ? "CUDA unavailable: " + reason : reason.substr(pos);
  }
  return info;
}

}  // namespace metrale::cuda
