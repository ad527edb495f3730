// METRALE_CPU_ISA caps the CPU kernels' instruction set (best_isa() reads it once per process,
// so the policy is tested through capped_isa): the three accepted values lower the best set, and
// anything else is named in a warning with the accepted values and ignored; the set in use is
// named with the device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "cpu/kernels/w4a16_cpu.h"
#include "metrale/cpu_backend.h"
#include "support/log_capture.h"

namespace metrale::cpu::w4a16 {
namespace {

TEST(CpuIsaSwitch, AcceptedValuesLowerTheBestSetSilently) {
  testing::LogCapture logs;
  EXPECT_EQ(capped_isa(Isa::kAvx512Bf16, nullptr), Isa::kAvx512Bf16);
  EXPECT_EQ(capped_isa(Isa::kAvx512Bf16, ""), Isa::kAvx512Bf16);
  EXPECT_EQ(capped_isa(Isa::kAvx512Bf16, "avx512"), Isa::kAvx512);
  EXPECT_EQ(capped_isa(Isa::kAvx512Bf16, "avx2"), Isa::kAvx2);
  EXPECT_EQ(capped_isa(Isa::kAvx512Bf16, "portable"), Isa::kPortable);
  // A cap never raises: a processor without AVX-512 keeps what it has.
  EXPECT_EQ(capped_isa(Isa::kAvx2, "avx512"), Isa::kAvx2);
  EXPECT_EQ(capped_isa(Isa::kPortable, "avx2"), Isa::kPortable);
  EXPECT_EQ(logs.count(log::Level::kWarn, "METRALE_CPU_ISA"), 0u);
}

TEST(CpuIsaSwitch, AnUnknownValueIsNamedInAWarningAndIgnored) {
  for (const char* value : {"avx-512", "AVX2", "sse4", "avx512_bf16x"}) {
    testing::LogCapture logs;
    EXPECT_EQ(capped_isa(Isa::kAvx512, value), Isa::kAvx512) << value;
    EXPECT_EQ(logs.count(log::Level::kWarn, std::string("METRALE_CPU_ISA=") + value +
                                                " is not one of avx512, avx2, portable"),
              1u)
        << value;
  }
}

// The set in use is public (benchmarks print it with their roof) and named in the device name,
// so a figure always says which kernels made it.
TEST(CpuIsaSwitch, TheSetInUseIsNamedWithTheDevice) {
  EXPECT_EQ(cpu_kernel_isa(), to_string(best_isa()));
  CpuBackend b;
  EXPECT_THAT(b.device_name(),
              ::testing::HasSubstr(std::string(to_string(best_isa())) + " kernels"));
}

}  // namespace
}  // namespace metrale::cpu::w4a16
