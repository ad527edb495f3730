// Loading the driver never crashes: a missing library and the toolkit's stub library each give
// a reason that starts with "CUDA unavailable:".
#include "cuda/driver_loader.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "cuda/status.h"

namespace metrale::cuda {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(DriverLoader, AMissingLibraryIsAReasonNotACrash) {
  const DriverLoad load = load_driver_from("libcuda-that-does-not-exist.so.1");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_THAT(load.reason, StartsWith("CUDA unavailable: cannot load libcuda-that-does-not-exist"));
  EXPECT_THAT(load.reason, HasSubstr("no NVIDIA driver is installed"));
}

TEST(DriverLoader, ALibraryWithoutTheDriverApiIsRefused) {
  // libm is on every machine and exports none of the driver's entry points.
  const DriverLoad load = load_driver_from("libm.so.6");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_THAT(load.reason, HasSubstr("exports no cuInit"));
}

#ifdef METRALE_STUB_DRIVER_DIR
TEST(DriverLoader, TheToolkitStubLibraryIsNamedAsSuch) {
  // fmt rather than operator+: GCC 12 warns falsely (-Warray-bounds) on that concatenation for
  // some lengths of the build folder's path.
  const std::string stub = fmt::format("{}/libcuda.so.1", METRALE_STUB_DRIVER_DIR);
  const DriverLoad load = load_driver_from(stub.c_str());
  EXPECT_EQ(load.api, nullptr);
  EXPECT_THAT(load.reason, StartsWith("CUDA unavailable: "));
  EXPECT_THAT(load.reason, HasSubstr("stub library"));
  EXPECT_THAT(load.reason, HasSubstr("CUDA_ERROR_STUB_LIBRARY (34)"));
}
#endif

TEST(DriverLoader, ADriverOlderThanTheKernelsNeedIsRefused) {
  EXPECT_EQ(driver_too_old(kRequiredDriverVersion), "");
  EXPECT_EQ(driver_too_old(kRequiredDriverVersion + 20), "");
  EXPECT_EQ(driver_too_old(12040),
            "CUDA unavailable: the driver supports CUDA 12.4; the embedded kernels need 13.0 or "
            "newer");
}

TEST(DriverStatus, DescribesStatusesEvenWithoutADriver) {
  EXPECT_EQ(describe_status(nullptr, CUDA_ERROR_OUT_OF_MEMORY),
            "CUDA_ERROR_OUT_OF_MEMORY (2): no description available");
  EXPECT_STREQ(status_name(CUDA_ERROR_ILLEGAL_ADDRESS), "CUDA_ERROR_ILLEGAL_ADDRESS");
  EXPECT_STREQ(status_name(static_cast<CUresult>(1000)), "CUDA_ERROR_UNRECOGNIZED");
}

}  // namespace
}  // namespace metrale::cuda
