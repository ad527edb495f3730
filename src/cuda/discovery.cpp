#include "cuda/discovery.h"

#include <fmt/format.h>

#include "cuda/dense_gemm.h"
#include "cuda/module_registry.h"

namespace metrale::cuda {

Unavailable unavailable(const Error& e) {
  std::string reason = e.code() == ErrorCode::kUnavailable
                           ? e.message()
                           : fmt::format("CUDA unavailable: {}", e.what());
  return Unavailable{std::move(reason), e};
}

Opening open_backend(const std::function<std::shared_ptr<CudaHost>()>& make_host,
                     std::span<const EmbeddedModule* const> modules) {
  try {
    std::shared_ptr<CudaHost> host = make_host();
    std::shared_ptr<ModuleRegistry> registry = ModuleRegistry::load(host, modules);
    auto backend = std::make_unique<CudaBackend>(std::move(host), std::move(registry));
    backend->require_kernels();
    return backend;
  } catch (const Error& e) {
    return unavailable(e);
  }
}

Opening open_backend() {
  return open_backend([] { return CudaHost::process(0); }, embedded_modules());
}

std::vector<std::pair<std::string, std::string>> device_properties(const CudaBackend& backend) {
  const DeviceInfo& d = backend.host().info();
  std::vector<std::pair<std::string, std::string>> out = {
      {"compute capability", fmt::format("{}.{}", d.cc.major, d.cc.minor)},
      {"SMs", fmt::format("{}", d.sm_count)},
      {"memory", fmt::format("{:.1f} GiB total, {:.1f} GiB free",
                             static_cast<double>(d.total_memory) / (1 << 30),
                             static_cast<double>(backend.free_memory()) / (1 << 30))},
      {"driver", fmt::format("CUDA {}.{}", d.driver_version / 1000, d.driver_version % 1000 / 10)},
      // Loads cuBLASLt (once per process) to say which dense GEMMs this backend offers.
      {"dense GEMMs", describe_dense_gemms(backend.host().blas(), d.cc)},
  };
  for (const std::string& s : backend.registry().skipped()) out.push_back({"skipped", s});
  return out;
}

}  // namespace metrale::cuda
