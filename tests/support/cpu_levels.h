// The CPU kernels' instruction-set levels this processor can run, for tests that call the
// w4a16 kernels directly at every level (a vector level it lacks would fault).
#pragma once

#include <vector>

#include "cpu/kernels/w4a16_cpu.h"

namespace metrale::testing {

inline std::vector<cpu::w4a16::Isa> runnable_levels() {
  using cpu::w4a16::Isa;
  std::vector<Isa> out{Isa::kPortable};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back(Isa::kAvx2);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    out.push_back(Isa::kAvx512);
    if (__builtin_cpu_supports("avx512bf16")) out.push_back(Isa::kAvx512Bf16);
  }
  return out;
}

}  // namespace metrale::testing
