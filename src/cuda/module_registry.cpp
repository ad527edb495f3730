#include "cuda/module_registry.h"

#include <fmt/format.h>

#include <optional>

#include "core/log.h"
#include "metrale/error.h"

namespace metrale::cuda {
namespace {

std::string targets_of(const EmbeddedModule& m) {
  return fmt::format("{}", fmt::join(m.targets, " "));
}

}  // namespace

std::vector<ModulePlan> preflight(std::span<const EmbeddedModule* const> modules,
                                  const DeviceInfo& device) {
  std::vector<ModulePlan> plans;
  bool any = false;
  std::string carried;
  for (const EmbeddedModule* m : modules) {
    std::vector<Target> targets;
    for (std::string_view t : m->targets) {
      if (const auto parsed = Target::parse(t)) targets.push_back(*parsed);
    }
    const TargetChoice choice = choose_target(targets, device.cc);
    any = any || choice.runs;
    plans.push_back(ModulePlan{m, choice});
    carried += fmt::format("{}{}: {}", carried.empty() ? "" : "; ", m->name, targets_of(*m));
  }
  if (!any) {
    throw Error(ErrorCode::kUnavailable, "cuda",
                fmt::format("CUDA unavailable: device {} ({}, {}) runs none of the embedded "
                            "modules ({})",
                            device.ordinal, device.name, device.cc.str(),
                            carried.empty() ? "none built" : carried));
  }
  return plans;
}

std::shared_ptr<ModuleRegistry> ModuleRegistry::load(
    std::shared_ptr<CudaHost> host, std::span<const EmbeddedModule* const> modules) {
  const std::vector<ModulePlan> plans = preflight(modules, host->info());
  std::shared_ptr<ModuleRegistry> reg(new ModuleRegistry(host));
  host->bind();
  for (const ModulePlan& p : plans) {
    if (!p.choice.runs) {
      reg->skipped_.push_back(fmt::format("{}: carries {}, nothing for {}", p.module->name,
                                          targets_of(*p.module), host->info().cc.str()));
      continue;
    }
    if (p.choice.via_ptx) {
      log::info(
          "cuda: module {} has no machine code for {}; the driver JIT-compiles its PTX "
          "({}) at load, which makes start-up slower",
          p.module->name, host->info().cc.str(), p.choice.target);
    }
    CUmodule handle = nullptr;
    if (const CUresult s = host->api().cuModuleLoadData(&handle, p.module->image.data());
        s != CUDA_SUCCESS) {
      reg->unload_all(false);  // a failed load leaves nothing loaded behind it
      throw_status(&host->api(), "cuda",
                   fmt::format("cuModuleLoadData({}, {} image)", p.module->name,
                               to_string(classify_image(p.module->image))),
                   s);
    }
    reg->loaded_.push_back(Loaded{p.module, handle, p.choice});
  }
  return reg;
}

ModuleRegistry::~ModuleRegistry() {
  unload_all(false);
}

const ModuleRegistry::Loaded* ModuleRegistry::find(std::string_view name) const {
  for (const Loaded& l : loaded_) {
    if (l.module->name == name) return &l;
  }
  return nullptr;
}

void ModuleRegistry::unload_all(bool throw_first) {
  std::optional<Error> first;
  if (!loaded_.empty()) host_->bind_quietly();  // unloading needs the context on this thread
  for (Loaded& l : loaded_) {
    const CUresult s = host_->api().cuModuleUnload(l.handle);
    if (s == CUDA_SUCCESS || is_context_gone(s)) continue;
    const std::string what = describe_status(&host_->api(), s);
    // The entry point is named, as every driver failure is: "failed" alone does not say which
    // call refused (the fault sweep found this warning naming none).
    log::warn("cuda: unloading module {} failed: cuModuleUnload: {}", l.module->name, what);
    if (!first) {
      first = Error(ErrorCode::kDriver, "release_registry",
                    fmt::format("cuModuleUnload({}) failed: {}", l.module->name, what));
    }
  }
  loaded_.clear();
  if (throw_first && first) throw *first;
}

void ModuleRegistry::release(std::shared_ptr<ModuleRegistry>& registry) {
  if (!registry) return;
  const long others = registry.use_count() - 1;
  if (others > 0) {
    throw Error(ErrorCode::kState, "release_registry",
                fmt::format("{} other holder(s) (a backend, or a kernel handle's owner) still "
                            "hold the module registry; nothing was unloaded",
                            others));
  }
  std::shared_ptr<ModuleRegistry> mine = std::move(registry);
  mine->unload_all(true);
}

}  // namespace metrale::cuda
