// One model's kernel modules, loaded into the host's context. Before anything is loaded a
// preflight matches each module's targets against the device's compute capability; a module
// that cannot run there is left out (has() says so), and a device that runs none is refused.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/embedded_modules.h"
#include "cuda/host.h"
#include "cuda/module_image.h"

namespace metrale::cuda {

// How each module would load on a device, without loading anything.
struct ModulePlan {
  const EmbeddedModule* module = nullptr;
  TargetChoice choice;
};

// Matches every module against cc. Throws Error(kUnavailable, "CUDA unavailable: ...") when
// none runs, naming the device and each module's targets.
std::vector<ModulePlan> preflight(std::span<const EmbeddedModule* const> modules,
                                  const DeviceInfo& device);

class ModuleRegistry {
 public:
  // Preflights, then loads every module that runs on host's device. Logs once per module that
  // only PTX fits (the driver JIT-compiles it, which makes start-up slower).
  static std::shared_ptr<ModuleRegistry> load(std::shared_ptr<CudaHost> host,
                                              std::span<const EmbeddedModule* const> modules);
  ModuleRegistry(const ModuleRegistry&) = delete;
  ModuleRegistry& operator=(const ModuleRegistry&) = delete;
  // Unloads whatever is still loaded (failures logged).
  ~ModuleRegistry();

  // Unloads every module now. Refuses, unloading nothing, while anything besides the caller
  // still holds the registry (Error kState saying how many others do); resets registry on
  // success. Rethrows the first unload failure after trying every module.
  static void release(std::shared_ptr<ModuleRegistry>& registry);

  struct Loaded {
    const EmbeddedModule* module = nullptr;
    CUmodule handle = nullptr;
    TargetChoice choice;
  };
  // Whether a module of that name is loaded.
  bool has(std::string_view name) const { return find(name) != nullptr; }
  // The loaded module of that name, or null.
  const Loaded* find(std::string_view name) const;
  // Every loaded module, in build order.
  const std::vector<Loaded>& loaded() const noexcept { return loaded_; }
  // Modules left out, each with the reason ("core: carries sm_90a only").
  const std::vector<std::string>& skipped() const noexcept { return skipped_; }
  // The host the modules live in.
  CudaHost& host() const noexcept { return *host_; }

 private:
  explicit ModuleRegistry(std::shared_ptr<CudaHost> host) : host_(std::move(host)) {}
  void unload_all(bool throw_first);

  std::shared_ptr<CudaHost> host_;
  std::vector<Loaded> loaded_;
  std::vector<std::string> skipped_;
};

}  // namespace metrale::cuda
