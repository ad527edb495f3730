// The modules every CPU backend loads unless told otherwise (CpuBackendOptions::modules): one
// place to add a built-in module, apart from the HostModule type that holds any module.
#include "cpu/modules/modules.h"
#include "metrale/host_module.h"

namespace metrale {

std::vector<HostModule> builtin_host_modules() {
  std::vector<HostModule> out;
  out.push_back(cpu::make_core_module());
  out.push_back(cpu::make_w4a16_module());
  out.push_back(cpu::make_blas_module());
  out.push_back(cpu::make_fp8_module());
  out.push_back(cpu::make_moe_module());
  return out;
}

}  // namespace metrale
