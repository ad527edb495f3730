#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "metrale/cpu_backend.h"
#include "metrale/op_cache.h"
#include "metrale/runtime.h"

namespace metrale::cli {
namespace {

// Every kernel of every module with the metadata its lookup published.
nlohmann::json cpu_modules(CpuBackend& cpu) {
  nlohmann::json modules = nlohmann::json::array();
  for (const std::string& name : cpu.module_names()) {
    nlohmann::json kernels = nlohmann::json::array();
    for (const HostKernel& k : cpu.module(name)->kernels()) {
      const KernelHandle h = cpu.op_cache().kernel(cpu, name, k.name);
      kernels.push_back({{"name", k.name},
                         {"n_tile", cpu.op_cache().n_tile(h)},
                         {"a_e4m3", cpu.kernel_casts_a_to_e4m3(h)},
                         {"params", k.param_sizes.size()}});
    }
    modules.push_back({{"name", name}, {"kernels", kernels}});
  }
  return modules;
}

}  // namespace

int run_info(const CommonOptions& options) {
  nlohmann::json doc;
  doc["backends"] = nlohmann::json::array();
  for (const BackendInfo& b : discover_backends()) {
    nlohmann::json j{{"name", b.name}, {"available", b.available}};
    if (!b.available) j["reason"] = b.reason;
    if (b.available) j["device"] = b.device;
    if (b.name == "cpu") {
      CpuBackend cpu;
      j["memory_total"] = cpu.total_memory();
      j["memory_free"] = cpu.free_memory();
      j["threads"] = cpu.sm_count();
      j["modules"] = cpu_modules(cpu);
    }
    doc["backends"].push_back(j);
  }
  if (options.json) {
    fmt::print("{}\n", doc.dump(2));
    return 0;
  }
  for (const auto& b : doc["backends"]) {
    if (!b["available"].get<bool>()) {
      fmt::print("{:<5} {}\n", b["name"].get<std::string>(), b["reason"].get<std::string>());
      continue;
    }
    fmt::print("{:<5} available: {}\n", b["name"].get<std::string>(),
               b["device"].get<std::string>());
    if (b.contains("memory_total")) {
      fmt::print("      memory {:.1f} GiB total, {:.1f} GiB free; {} threads\n",
                 b["memory_total"].get<double>() / (1 << 30),
                 b["memory_free"].get<double>() / (1 << 30), b["threads"].get<unsigned>());
    }
    if (!b.contains("modules")) continue;
    for (const auto& m : b["modules"]) {
      fmt::print("      module {}\n", m["name"].get<std::string>());
      for (const auto& k : m["kernels"]) {
        fmt::print("        {:<24} n_tile {:>5}  a_e4m3 {:<5}  params {}\n",
                   k["name"].get<std::string>(), k["n_tile"].get<unsigned>(),
                   k["a_e4m3"].get<bool>() ? "yes" : "no", k["params"].get<unsigned>());
      }
    }
  }
  return 0;
}

}  // namespace metrale::cli
