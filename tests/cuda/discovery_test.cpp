// CUDA discovery hands back a backend or why not as data (cuda::Unavailable), and the registry
// passes that reason on unchanged: nothing reads it back out of an Error's what().
#include "cuda/discovery.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "core/expect_error.h"
#include "cuda/driver_loader.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/runtime.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using ::testing::StartsWith;

// Opens a backend on the rig's fake driver, as discovery opens one on the real driver.
Opening open_on(Rig& rig) {
  return open_backend([&] { return CudaHost::create(rig.table, 0, kDriverVersion); },
                      rig.modules.span());
}

TEST(CudaDiscovery, NoDeviceGivesTheReasonAsDataAndTheErrorToThrow) {
  Rig rig({.devices = {}, .make_registry = false});
  Opening opening = open_on(rig);
  ASSERT_TRUE(std::holds_alternative<Unavailable>(opening));
  const Unavailable& no = std::get<Unavailable>(opening);
  EXPECT_EQ(no.reason, "CUDA unavailable: no CUDA device");  // no "[cuda] " in front
  EXPECT_EQ(no.error.code(), ErrorCode::kUnavailable);
  EXPECT_STREQ(no.error.what(), "[cuda] CUDA unavailable: no CUDA device");
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaDiscovery, ADeviceThatRunsNoModuleGivesThePreflightReason) {
  FakeDevice turing;
  turing.name = "Fake T4";
  turing.cc_major = 7;
  turing.cc_minor = 5;
  Rig rig({.devices = {turing}, .make_registry = false});
  Opening opening = open_on(rig);
  ASSERT_TRUE(std::holds_alternative<Unavailable>(opening));
  const Unavailable& no = std::get<Unavailable>(opening);
  EXPECT_THAT(no.reason, StartsWith("CUDA unavailable: device 0 (Fake T4, sm_75) runs none of "
                                    "the embedded modules"));
  EXPECT_EQ(no.error.code(), ErrorCode::kUnavailable);
  EXPECT_EQ(no.error.message(), no.reason);
}

TEST(CudaDiscovery, AFailedDriverCallIsAReasonNamingTheCallAndKeepsItsCode) {
  Rig rig({.make_registry = false});
  rig.fd.fail_at("cuDevicePrimaryCtxRetain", 1, CUDA_ERROR_INVALID_DEVICE);
  Opening opening = open_on(rig);
  ASSERT_TRUE(std::holds_alternative<Unavailable>(opening));
  const Unavailable& no = std::get<Unavailable>(opening);
  EXPECT_THAT(no.reason, StartsWith("CUDA unavailable: [cuda] cuDevicePrimaryCtxRetain failed: "
                                    "CUDA_ERROR_INVALID_DEVICE (101)"));
  EXPECT_EQ(no.error.code(), ErrorCode::kDriver);
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaDiscovery, AUsableDeviceGivesABackendAndItsProperties) {
  Rig rig({.make_registry = false});
  Opening opening = open_on(rig);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<CudaBackend>>(opening));
  const CudaBackend& backend = *std::get<std::unique_ptr<CudaBackend>>(opening);
  EXPECT_EQ(backend.device_name(), "Fake H200");
  const auto properties = device_properties(backend);
  ASSERT_GE(properties.size(), 4u);
  EXPECT_EQ(properties[0], (std::pair<std::string, std::string>{"compute capability", "9.0"}));
  EXPECT_EQ(properties[1], (std::pair<std::string, std::string>{"SMs", "132"}));
}

// The registry on this process's real driver. Without one (a build machine, or the stub library
// on the loader path: ctest runs this case both ways), the reason the loader gave reaches
// discovery, auto and an explicit "cuda" unchanged.
TEST(CudaDiscovery, TheRegistryPassesTheLoadersReasonOnUnchanged) {
  const DriverLoad& load = load_driver();
  if (load.api != nullptr) GTEST_SKIP() << "a CUDA driver is installed";
  ASSERT_THAT(load.reason, StartsWith("CUDA unavailable: "));

  const std::vector<BackendInfo> found = discover_backends();
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].name, "cuda");
  EXPECT_FALSE(found[0].available);
  EXPECT_EQ(found[0].reason, load.reason);
  EXPECT_EQ(found[1].name, "cpu");
  EXPECT_TRUE(found[1].available);

  std::string why;
  const std::unique_ptr<Backend> fallback = create_backend("auto", &why);
  EXPECT_EQ(fallback->name(), "cpu");
  EXPECT_EQ(why, "cpu: " + load.reason);

  const Error e = expect_error([] { create_backend("cuda"); });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_EQ(e.api(), "cuda");
  EXPECT_EQ(e.message(), load.reason);
}

}  // namespace
}  // namespace metrale::cuda::testing
