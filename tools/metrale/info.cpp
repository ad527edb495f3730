#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "metrale/communicator.h"
#include "metrale/runtime.h"

namespace metrale::cli {

int run_info(const CommonOptions& options) {
  const std::vector<BackendInfo> backends = discover_backends();
  // The collective transports for tensor parallelism: each library is loaded (never started)
  // to say whether it is there; a missing one is a line, not a failure.
  const std::vector<TransportInfo> transports = discover_transports();
  if (options.json) {
    nlohmann::json doc;
    doc["backends"] = nlohmann::json::array();
    for (const BackendInfo& b : backends) {
      nlohmann::json j{{"name", b.name}, {"available", b.available}};
      if (!b.available) j["reason"] = b.reason;
      if (b.available) j["device"] = b.device;
      for (const auto& [key, value] : b.properties) j["properties"][key] = value;
      j["modules"] = nlohmann::json::array();
      for (const ModuleDescription& m : b.modules) {
        nlohmann::json kernels = nlohmann::json::array();
        for (const KernelListing& k : m.kernels) {
          kernels.push_back({{"name", k.name},
                             {"n_tile", k.n_tile},
                             {"a_e4m3", k.a_e4m3},
                             {"verified", k.verified}});
        }
        j["modules"].push_back({{"name", m.name}, {"target", m.target}, {"kernels", kernels}});
      }
      doc["backends"].push_back(j);
    }
    doc["transports"] = nlohmann::json::array();
    for (const TransportInfo& t : transports) {
      doc["transports"].push_back({{"name", t.name},
                                   {"available", t.available},
                                   {t.available ? "library" : "reason", t.detail}});
    }
    fmt::print("{}\n", doc.dump(2));
    return 0;
  }
  for (const BackendInfo& b : backends) {
    if (!b.available) {
      fmt::print("{:<5} {}\n", b.name, b.reason);
      continue;
    }
    fmt::print("{:<5} available: {}\n", b.name, b.device);
    for (const auto& [key, value] : b.properties) fmt::print("      {}: {}\n", key, value);
    for (const ModuleDescription& m : b.modules) {
      fmt::print("      module {} ({})\n", m.name, m.target);
      for (const KernelListing& k : m.kernels) {
        fmt::print("        {:<24} n_tile {:>5}  a_e4m3 {:<3}  {}\n", k.name, k.n_tile,
                   k.a_e4m3 ? "yes" : "no", k.verified);
      }
    }
  }
  for (const TransportInfo& t : transports) {
    fmt::print("{:<5} {}{}\n", t.name, t.available ? "available: " : "", t.detail);
  }
  return 0;
}

}  // namespace metrale::cli
