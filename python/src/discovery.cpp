// backends(): what discovery found, as plain Python data.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.h"
#include "metrale/runtime.h"

namespace nb = nanobind;

namespace metrale::py {

void bind_discovery(nb::module_& m) {
  m.def(
      "backends",
      [] {
        std::vector<BackendInfo> found;
        {
          nb::gil_scoped_release unlocked;  // creating a CUDA context takes a while
          found = discover_backends();
        }
        nb::list out;
        for (const BackendInfo& info : found) {
          nb::dict d;
          d["name"] = info.name;
          d["available"] = info.available;
          d["reason"] = info.reason;
          d["device"] = info.device;
          nb::dict properties;
          for (const auto& [key, value] : info.properties) properties[key.c_str()] = value;
          d["properties"] = properties;
          nb::list modules;
          for (const ModuleDescription& md : info.modules) {
            nb::list kernels;
            for (const KernelListing& k : md.kernels) kernels.append(k.name);
            nb::dict mod;
            mod["name"] = md.name;
            mod["target"] = md.target;
            mod["kernels"] = kernels;
            modules.append(mod);
          }
          d["modules"] = modules;
          out.append(d);
        }
        return out;
      },
      "Every backend kind, the preferred first: name, available, reason (why not), device, "
      "properties and loaded modules.");
}

}  // namespace metrale::py
