// Factories of the CPU backend's built-in host modules.
#pragma once

#include "metrale/host_module.h"

namespace metrale::cpu {

// Module "core": element-wise kernels (fill_u32, axpy_f32) that publish their N tiles.
HostModule make_core_module();

}  // namespace metrale::cpu
